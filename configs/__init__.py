"""dpltm's shipped settings (YAML), installed as the package data `dpltm.configs`: defaults.yaml, a
file per dataset (datasets/), training recipes (recipes/) and the experiment grids (experiments/).
Read through importlib.resources (dpltm.config.CONFIG_DIR), so an installed wheel reads its own copy."""
