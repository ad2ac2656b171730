#!/usr/bin/env bash
# Every GPU check the project owes, as one command for a lent machine's short lease (about 8 minutes):
#   1. `pytest -m gpu`: the CUDA and CUDA-graph paths against the eager ones;
#   2. benchmarks/bench_dp_step.py --device cuda: the DP graph step against the non-private graph step
#      (target ≤ 1.2×) and against Opacus (target ≥ 4× ahead of ghost clipping), with each graph step's kernel count
#      and device time under torch.profiler;
#   2b. benchmarks/bench_callback.py --device cuda: a Lightning fit with DPCallback against one without DP and against
#      make_private's step (the callback's closure wrapping and per-step weight marks each sync the device once);
#   2c. benchmarks/bench_models.py --device cuda: ResNet-18 (GroupNorm), a transformer encoder, a GroupNorm CNN and an
#      embedding model, dpltm's DP step (dense, masked) against Opacus ghost clipping and hooks: time and peak memory;
#   3. benchmarks/bench_generate.py --device cuda --graphs-only: IMP in graphs against a bare graph loop (≤ 1.1×);
#   4. the README's `dpltm run --cuda-graphs`, twice (target on an H100 ≤ 20 s): run-cold with no tickets or features
#      cached, as a user's first run after `pip install`; run-warm with both cached;
#   5. `dpltm generate --rewind-step 100 --cuda-graphs` (late rewinding's snapshot inside the graph blocks).
# First, here: `bash benchmarks/gpu/prepare.sh`. Then the device tool's
#   run(command="bash benchmarks/gpu/check.sh", carry=[".whl", ".gpu-data"], timeout_s=600)
# `bash benchmarks/gpu/check.sh run-cold run-warm` runs only the steps named (a rerun after a fix, on what is left of a lease).
# Logs go to $OUT (the device tool brings them back); each step has its own time limit, and a failed step
# does not stop the others. The exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LC_NUMERIC=C  # the step timer's decimal point
STEPS=" pytest-gpu bench-dp-step bench-callback bench-models bench-generate run-cold run-warm generate-rewind "
for name in "$@"; do
    [[ "$STEPS" == *" $name "* ]] || { echo "check.sh: no step named '$name' (steps:$STEPS)" >&2; exit 104; }
done
OUT=${OUT:-/tmp/dpltm-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 100
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
# An editable install, as the README's: configs/ is the package dpltm.configs only through the install's mapping
# (pyproject's package-dir), so the source tree on PYTHONPATH alone cannot load the defaults.
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .; then
    echo "no editable install here (setuptools?): dpltm/configs linked to configs/ in this copy instead"
    [ -e dpltm/configs ] || ln -s ../configs dpltm/configs || exit 102
fi
# The image lacks bytecode for much of what a run imports, and writes none: every `dpltm run` there compiled about
# 1,900 modules from source, 7.2-7.4 s of it on an H100 (cProfile, 2026-11-27). pip writes bytecode at install, so a
# user's runs do not pay that: the runs get a bytecode cache of their own, filled before any is timed.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/dpltm-pycache
export DPLTM_DATA_DIR="${DPLTM_DATA_DIR:-$PWD/.gpu-data}" DPLTM_FEATURE_CACHE=/tmp/dpltm-features \
    DPLTM_TICKET_CACHE=/tmp/dpltm-tickets DPLTM_LOG_DIR=/tmp/dpltm-logs PYTHONUNBUFFERED=1
failed=0
only=" $* "
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output to the screen and $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
    echo "== $(date +%T) $name"
    local start=$EPOCHREALTIME
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name: exit $rc after $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, lightning, dp_accounting, kymatio, dpltm; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 101
# the bytecode of every package a run imports (compileall writes under PYTHONPYCACHEPREFIX), a few seconds on 16 cores
packages=$(python3 -c "import importlib.util as u
for name in ('torch', 'lightning', 'lightning_utilities', 'torchmetrics', 'transformers', 'sympy', 'scipy', 'numpy',
             'dp_accounting', 'kymatio', 'mpi4py', 'typer', 'click', 'rich', 'yaml', 'tqdm', 'opacus', 'dpltm'):
    spec = u.find_spec(name)
    print(*(spec.submodule_search_locations or []) if spec else [])") || exit 103
python3 -m compileall -qq -j 0 $packages configs > /dev/null 2>&1  # a file some package never meant to compile: no matter
step pytest-gpu 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -o addopts=""
step bench-dp-step 90 python3 benchmarks/bench_dp_step.py --device cuda --kernels-out "$OUT/kernels.txt"
step bench-callback 90 python3 benchmarks/bench_callback.py --device cuda
step bench-models 150 python3 benchmarks/bench_models.py --device cuda --steps 5 --warmup 2
step bench-generate 60 python3 benchmarks/bench_generate.py --device cuda --graphs-only --steps 5000 --dataset kmnist --split test
step run-cold 90 python3 -m dpltm.cli run --device cuda --cuda-graphs --overwrite --out /tmp/dpltm-run/model.pt
step run-warm 90 python3 -m dpltm.cli run --device cuda --cuda-graphs --overwrite --out /tmp/dpltm-run/model.pt
step generate-rewind 60 python3 -m dpltm.cli generate --dataset kmnist --split test --rounds 2 --rewind-step 100 \
    --cuda-graphs --device cuda --overwrite --out /tmp/dpltm-run/rewind-tickets.pt
echo "== failed steps: $failed"
exit "$failed"
