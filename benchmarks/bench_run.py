"""Wall time of `dpltm run` as users run it (a subprocess of the installed CLI), in one table.

By default the README's own command, `dpltm run` with no flags (the ScatterNet front end where it
applies: docs/results.md), timed `--repeats` times *cold* (each with empty feature and public-ticket
caches, so the scattering features of both datasets and the public tickets are computed) and as many
times *warm* (both caches filled by a first run), with the median of each. `--paper` times the paper's
configuration instead: tickets from KMNIST (test split), 10 IMP rounds of 5000 steps, the paper's score
for the choice (`--choice best`), 50 DP epochs on MNIST at ε = 1 with the paper's recipe. On CUDA the
run is also timed with `--cuda-graphs` (target on an H100: ≤ 20 s). `--fresh-clone` first clones this
repository into a temporary folder and times the README's install command there too.

    python benchmarks/bench_run.py [--device cpu|cuda] [--repeats 3] [--paper] [--fresh-clone] [-- extra flags]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpltm.privacy.display import format_epsilon

REPO = Path(__file__).resolve().parent.parent
PAPER_RUN = ["--recipe", "paper", "--choice", "best", "--eps", "1"]


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> float:
    return timed_run(command, cwd, env)[0]


def timed_run(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Seconds and standard output of one command (a failure ends the benchmark with its stderr)."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def _label(name: str, times: list[float]) -> str:
    return name if len(times) == 1 else f"{name} (median of {', '.join(f'{t:.0f}' for t in times)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fresh-clone", action="store_true", help="clone, install (timed), then run")
    parser.add_argument("--paper", action="store_true", help="the paper's configuration, not the README's command")
    parser.add_argument("--repeats", type=int, default=1, help="cold and warm runs each (median shown)")
    parser.add_argument("extra", nargs="*", help="more `dpltm run` flags (after --)")
    args = parser.parse_args()
    env = {**os.environ}
    if "DPLTM_DATA_DIR" not in env and (REPO.parent / "shared" / "data").is_dir():
        env["DPLTM_DATA_DIR"] = str(REPO.parent / "shared" / "data")
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="dpltm-bench-run-") as tmp:
        work = Path(tmp)
        cli = [sys.executable, "-m", "dpltm.cli"]
        if args.fresh_clone:
            checkout = work / "checkout"
            subprocess.run(["git", "clone", "--quiet", str(REPO), str(checkout)], check=True)
            rows["install (python -m venv + pip install -e .)"] = timed(
                ["bash", "-c", "python3 -m venv .venv && .venv/bin/pip install --quiet -c constraints.txt -e ."],
                checkout, env)
            cli = [str(checkout / ".venv" / "bin" / "dpltm")]  # the README's command
        config = PAPER_RUN if args.paper else []
        modes = {"dpltm run (eager)": []}
        if args.device.startswith("cuda"):
            modes["dpltm run --cuda-graphs"] = ["--cuda-graphs"]
        warm_cache = work / "warm-feature-cache"
        accuracies: list[str] = []

        def run_once(flags: list[str], cache: Path, k: int) -> float:
            out = work / f"run-{k}" / "model.pt"
            command = [*cli, "run", *config, "--device", args.device, "--no-progress", "--json", "--out", str(out),
                       *flags, *args.extra]
            seconds, stdout = timed_run(command, work, {**env, "DPLTM_FEATURE_CACHE": str(cache / "features"),
                                                        "DPLTM_TICKET_CACHE": str(cache / "tickets"),
                                                        "DPLTM_LOG_DIR": str(work)})
            report = json.loads(stdout)
            accuracies.append(f"{report['test_accuracy']:.4f} (ε {format_epsilon(report['epsilon'])})")
            shutil.rmtree(out.parent, ignore_errors=True)
            return seconds

        for name, flags in modes.items():
            cold = []
            for k in range(args.repeats):
                cache = work / f"cold-cache-{k}"
                cold.append(run_once(flags, cache, k))
                if not warm_cache.exists() and cache.exists():
                    cache.rename(warm_cache)  # what a first run leaves: the warm runs' cache
                shutil.rmtree(cache, ignore_errors=True)
            rows[_label(f"{name} cold", cold)] = statistics.median(cold)
            if warm_cache.exists():  # features or public tickets were cached
                warm = [run_once(flags, warm_cache, k) for k in range(args.repeats)]
                rows[_label(f"{name} warm", warm)] = statistics.median(warm)
    print(f"device={args.device} config: dpltm run {' '.join(config + args.extra)}")
    print(f"{'what':<48}{'seconds':>10}")
    for name, seconds in rows.items():
        print(f"{name:<48}{seconds:>10.1f}")
    print(f"test accuracy of each run, in order: {', '.join(accuracies)}")
    if args.fresh_clone:
        total = rows["install (python -m venv + pip install -e .)"] + next(
            v for k, v in rows.items() if k.startswith("dpltm run (eager) cold"))
        print(f"fresh clone, install and a cold run: {total:.0f} s")


if __name__ == "__main__":
    main()
