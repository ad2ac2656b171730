#!/usr/bin/env bash
# The image's install steps, kept out of the Dockerfile so that CI runs them too (no Docker engine
# is needed to test them): a virtualenv at PREFIX with dpltm installed from SOURCE as a normal,
# non-editable package (its YAML configs inside it), then a smoke check of the installed command.
#   docker/install.sh PREFIX [SOURCE]     (SOURCE defaults to this checkout)
# Extra pip options (e.g. --constraint FILE) come from $DPLTM_PIP_OPTIONS, extras from $DPLTM_EXTRAS.
set -euo pipefail
prefix="${1:?usage: docker/install.sh PREFIX [SOURCE]}"
source_dir="${2:-$(cd "$(dirname "$0")/.." && pwd)}"
python3 -m venv "$prefix"
# shellcheck disable=SC2086  # options are words
# Extras for an image people run: --download (torchvision), --logger tensorboard, dpltm plot.
extras="${DPLTM_EXTRAS-download,tensorboard,plots}"
"$prefix/bin/pip" install --no-cache-dir --quiet ${DPLTM_PIP_OPTIONS:-} "$source_dir${extras:+[$extras]}"
# The installed package, not the source tree: run from a directory that holds no dpltm/.
cd /
"$prefix/bin/python" - <<'PY'
import importlib.util, pathlib
import dpltm
from dpltm.config import CONFIG_DIR
assert "site-packages" in pathlib.Path(dpltm.__file__).as_posix(), dpltm.__file__
assert (CONFIG_DIR / "defaults.yaml").is_file() and (CONFIG_DIR / "recipes" / "tuned.yaml").is_file()
assert importlib.util.find_spec("dp_accounting") is not None
assert (CONFIG_DIR / "recipes" / "scatter.yaml").is_file()
from dpltm.networks.scatter import scattering_class  # kymatio's 2-D torch front end: `dpltm run`'s default
scattering_class()
print(f"dpltm {dpltm.__version__} installed at {pathlib.Path(dpltm.__file__).parent}")
PY
"$prefix/bin/dpltm" account --dataset-size 60000 --batch-size 400 --epochs 1 --sigma 1.0 --json > /dev/null
if [[ ",$extras," == *",download,"* ]]; then "$prefix/bin/python" -c "import torchvision.datasets"; fi
echo "docker/install.sh: $prefix/bin/dpltm works"
