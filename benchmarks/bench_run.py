"""Wall time of `dpltm run` as users run it (a subprocess of the installed CLI), in one table.

The paper's configuration by default: tickets from KMNIST (test split), 10 IMP rounds of 5000
steps, the paper's score for the choice (`--choice best`), 50 DP epochs on MNIST at ε = 1 with
the paper's recipe. On CUDA the run is timed eagerly and with `--cuda-graphs` (target on an H100:
≤ 20 s). `--fresh-clone` first clones this repository into a temporary folder and times the
README's install command there too (target on 2 CPU cores: install and run ≤ 6 min).

    python benchmarks/bench_run.py [--device cpu|cuda] [--fresh-clone] [-- extra dpltm run flags]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAPER_RUN = ["--recipe", "paper", "--choice", "best", "--eps", "1"]


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fresh-clone", action="store_true", help="clone, install (timed), then run")
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
        modes = {"dpltm run (eager)": []}
        if args.device.startswith("cuda"):
            modes["dpltm run --cuda-graphs"] = ["--cuda-graphs"]
        for name, flags in modes.items():
            out = work / f"run-{len(rows)}" / "model.pt"
            command = [*cli, "run", *PAPER_RUN, "--device", args.device, "--no-progress",
                       "--out", str(out), *flags, *args.extra]
            rows[name] = timed(command, work, env)
            shutil.rmtree(out.parent, ignore_errors=True)
    print(f"device={args.device} config: {' '.join(PAPER_RUN + args.extra)}")
    print(f"{'what':<48}{'seconds':>10}")
    for name, seconds in rows.items():
        print(f"{name:<48}{seconds:>10.1f}")
    if args.fresh_clone:
        total = rows["install (python -m venv + pip install -e .)"] + rows["dpltm run (eager)"]
        print(f"fresh clone, install and run: {total:.0f} s (CPU target <= 360 s)")
    if "dpltm run --cuda-graphs" in rows:
        print(f"dpltm run --cuda-graphs: {rows['dpltm run --cuda-graphs']:.1f} s (H100 target <= 20 s)")


if __name__ == "__main__":
    main()
