"""Throughput of multi-process DP training (Lightning DDP) against one process, in one table.

`dpltm train --dense` on the same data, ε, epochs and seed, with `--devices 1` and `--devices N`
(CPU: gloo processes, each given cores/N threads so the machine is not oversubscribed; CUDA: one
GPU each). Prints wall time (process start-up and data loading included), the records per second
of DP training that implies, and checks that every run reports the same ε.

    python benchmarks/bench_ddp.py [--dataset mnist] [--epochs 2] [--devices 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=400)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    env = {**os.environ}
    if "DPLTM_DATA_DIR" not in env and (REPO.parent / "shared" / "data").is_dir():
        env["DPLTM_DATA_DIR"] = str(REPO.parent / "shared" / "data")
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpltm-bench-ddp-") as tmp:
        for devices in (1, args.devices):
            threads = max(1, cores // devices) if args.device == "cpu" else cores
            command = [sys.executable, "-m", "dpltm.cli", "train", "--dense", "--dataset", args.dataset,
                       "--eps", "1", "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                       "--device", args.device, "--devices", str(devices), "--noise-seed", "1", "--no-progress",
                       "--json", "--out", str(Path(tmp) / f"model-{devices}.pt")]
            start = time.perf_counter()
            result = subprocess.run(command, env={**env, "OMP_NUM_THREADS": str(threads)}, text=True,
                                    capture_output=True, cwd=tmp)
            seconds = time.perf_counter() - start
            if result.returncode != 0:
                raise SystemExit(result.stderr[-3000:])
            report = json.loads(result.stdout)
            rows.append((devices, threads, seconds, report))
    records = rows[0][3]["steps"] * args.batch_size
    print(f"device={args.device} dataset={args.dataset} epochs={args.epochs} L={args.batch_size} cores={cores}")
    print(f"{'processes':>10}{'threads each':>14}{'wall s':>10}{'records/s':>12}{'ε':>10}{'test acc':>10}")
    for devices, threads, seconds, report in rows:
        print(f"{devices:>10}{threads:>14}{seconds:>10.1f}{records / seconds:>12.0f}"
              f"{report['epsilon']:>10.4f}{report['test_accuracy']:>10.4f}")
    same = len({json.dumps(r[3]["privacy"], sort_keys=True) for r in rows}) == 1
    print(f"same ε and privacy statement on every run: {same}")
    print(f"speed-up of {args.devices} processes: {rows[0][2] / rows[1][2]:.2f}x")


if __name__ == "__main__":
    main()
