"""The experiment grid behind docs/results.md: not part of the library.

`experiment` runs the grid (methods × datasets × ε × seeds, resumable), `report` turns its rows
into tables and figures, `recipe_search` is the public-data recipe search; the grid's profiles are
in profiles/. Run through benchmarks/reproduce.py and benchmarks/tune_recipe.py; tests import it as
`grid` (pytest's pythonpath includes benchmarks/).
"""

from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"
