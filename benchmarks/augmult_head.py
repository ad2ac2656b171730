"""Augmentation multiplicity on the ScatterNet linear head, measured through the CLI: K views per record.

Each cell runs `dpltm train --dense --arch scatter-linear --recipe scatter --dataset D --eps E --seed S
--augmult K --json` (the scatter recipe: L = 4096, 40 epochs, SGD momentum 0.9, lr = 1/σ, clip 1) in its own
process, one at a time, with OMP_NUM_THREADS=1, and reports the test accuracy (mean ± std over the seeds, K = 1
being the dense DP-SGD baseline of the same script and seeds), the ε the run states (the same for every K: the
views do not change the sampling or the sensitivity) and the wall time per run. The features of each view are
computed once and cached (dpltm.feature_cache), so a cell's first run pays for them; the time of the later
runs is the training's.

    OMP_NUM_THREADS=1 python benchmarks/augmult_head.py --datasets mnist fashion-mnist --eps 1 0.2 \\
        --seeds 0 1 2 --views 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_cell(dataset: str, eps: float, seed: int, views: int, out: str) -> tuple[float, float, float]:
    """(test accuracy, ε stated, wall seconds) of one CLI run."""
    command = [sys.executable, "-m", "dpltm.cli", "train", "--dense", "--arch", "scatter-linear", "--recipe",
               "scatter", "--dataset", dataset, "--eps", str(eps), "--seed", str(seed), "--augmult", str(views),
               "--device", "cpu", "--no-progress", "--json", "--overwrite", "--logger", "none", "--out", out]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"augmult_head.py: {' '.join(command[2:])} failed: {done.stderr.strip()[-400:]}")
    report = json.loads(done.stdout)
    return report["test_accuracy"], report["epsilon"], wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist", "fashion-mnist"])
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--views", type=int, nargs="+", default=[1, 4], help="K values (1: the dense baseline)")
    parser.add_argument("--out", default="/tmp/augmult_head.pt", help="model file each run overwrites")
    args = parser.parse_args(argv)
    for dataset in args.datasets:
        for eps in args.eps:
            for views in args.views:
                runs = [run_cell(dataset, eps, seed, views, args.out) for seed in args.seeds]
                accs = [r[0] for r in runs]
                spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
                print(f"{dataset} ε={eps} K={views}: {statistics.mean(accs):.4f} ± {spread:.4f} "
                      f"{[round(a, 4) for a in accs]} ε stated {max(r[1] for r in runs):.4f}; "
                      f"wall {[round(r[2]) for r in runs]} s", flush=True)


if __name__ == "__main__":
    main()
