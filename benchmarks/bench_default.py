"""Does the default lose to the plain baseline? The README job against dense DP-SGD of the same front end, paired.

For each dataset, ε and seed — seeds the experiment grid never used (it used 0, 1, 2) — two runs as users run them
(subprocesses of the installed CLI): the README's job, `dpltm run --dataset D --eps E --seed S` (its recipe
chosen by `--recipe auto`, the public ticket by the noise-aware choice), and the dense baseline on the front end
and recipe that job picked (`dpltm train --dense --arch scatter-linear --recipe scatter` where it picks
scatter). Both spend ε on the same private data with δ = 1e-5 and draw fresh noise from the OS; the paired
difference (job − dense) per seed, and its mean ± standard deviation, say whether the default costs accuracy.
The target (issue: "a default that never loses to the plain baseline"): mean paired difference ≥ 0 everywhere.

`--common-noise` pairs the two runs with common random numbers: both take `--noise-seed` = the seed (a reproducible
noise stream, labelled as such in their reports; never for a release), so a difference left is the choice's alone,
not two independent noise draws'. Where the job trains the very mechanism the baseline does, every pair is equal.

    python benchmarks/bench_default.py [--datasets mnist fashion-mnist] [--eps 1 0.2] [--seeds 101 102 103 104 105]
        [--common-noise]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpltm.privacy.display import format_epsilon

REPO = Path(__file__).resolve().parent.parent
GRID_SEEDS = (0, 1, 2)
"""The seeds of benchmarks/grid's profiles: a choice rule tuned on them is measured here on others."""
DENSE_OF_RECIPE = {"scatter": ["--arch", "scatter-linear", "--recipe", "scatter"], "tuned": ["--recipe", "tuned"],
                   "cnn": ["--arch", "lenet5", "--recipe", "cnn"], "paper": ["--recipe", "paper"]}
"""The dense baseline of each recipe `--recipe auto` may pick: the same network family and training settings."""


def dpltm(args: list[str], env: dict[str, str]) -> tuple[dict[str, object], float]:
    """One CLI run's JSON report and wall time; a failure ends the benchmark with its last lines."""
    start = time.perf_counter()
    progress = [] if args[0] == "inspect" else ["--no-progress"]
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", *args, "--json", *progress], cwd=REPO, env=env,
                            text=True, capture_output=True)
    if result.returncode != 0:
        raise SystemExit(f"dpltm {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout), time.perf_counter() - start


def recipe_of(model: str, env: dict[str, str]) -> str:
    """The recipe `--recipe auto` took for a job, read from the network it trained (`dpltm inspect`)."""
    architecture = dpltm(["inspect", model], env)[0]["architecture"]
    name = architecture.get("name") or ""  # type: ignore[union-attr]
    if name.startswith("scatter-"):
        return "scatter"
    if architecture.get("conv"):  # type: ignore[union-attr]
        return "cnn"
    return "tuned" if architecture.get("activation") == "tanh" else "paper"  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fashion-mnist"])
    parser.add_argument("--eps", nargs="+", type=float, default=[1.0, 0.2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[101, 102, 103, 104, 105])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json-out", type=Path, help="also write every run's figures here")
    parser.add_argument("--common-noise", action="store_true",
                        help="both runs of a pair draw their noise from --noise-seed SEED (common random numbers)")
    args = parser.parse_args()
    if set(args.seeds) & set(GRID_SEEDS):
        raise SystemExit(f"seeds {sorted(set(args.seeds) & set(GRID_SEEDS))} were the grid's: take others")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpltm-bench-default-") as scratch:
        env = {**os.environ, "DPLTM_LOG_DIR": f"{scratch}/logs", "PYTHONUNBUFFERED": "1",
               "DPLTM_FEATURE_CACHE": os.environ.get("DPLTM_FEATURE_CACHE", f"{scratch}/features"),
               "DPLTM_TICKET_CACHE": os.environ.get("DPLTM_TICKET_CACHE", f"{scratch}/tickets")}
        for dataset in args.datasets:
            for eps in args.eps:
                for seed in args.seeds:
                    common = ["--dataset", dataset, "--eps", f"{eps:g}", "--seed", str(seed), "--device", args.device,
                              *(["--noise-seed", str(seed)] if args.common_noise else [])]
                    job, job_s = dpltm(["run", *common, "--out", f"{scratch}/job.pt", "--overwrite"], env)
                    recipe = recipe_of(f"{scratch}/job.pt", env)
                    dense, dense_s = dpltm(["train", "--dense", *DENSE_OF_RECIPE[recipe], *common,
                                            "--out", f"{scratch}/dense.pt", "--overwrite"], env)
                    row = {"dataset": dataset, "eps": eps, "seed": seed, "recipe": recipe,
                           "job": job["test_accuracy"], "dense": dense["test_accuracy"],
                           "job_epsilon": job["epsilon"], "dense_epsilon": dense["epsilon"],
                           "job_s": round(job_s, 1), "dense_s": round(dense_s, 1)}
                    rows.append(row)
                    print(f"{dataset:14s} ε={eps:<4g} seed {seed}: job {row['job']:.4f} (ε ≤ "
                          f"{format_epsilon(float(job['epsilon']))}, {job_s:.0f} s), dense {row['dense']:.4f} "
                          f"({dense_s:.0f} s), job − dense {row['job'] - row['dense']:+.4f}", flush=True)
    print(f"\nnoise: {'common (--noise-seed = seed)' if args.common_noise else 'fresh OS noise in every run'}")
    print(f"{'dataset':14s} {'ε':>5s} {'n':>2s}  {'job':>15s}  {'dense':>15s}  {'job − dense (paired)':>22s}")
    verdicts = []
    for dataset in args.datasets:
        for eps in args.eps:
            cell = [r for r in rows if r["dataset"] == dataset and r["eps"] == eps]
            job = [float(r["job"]) for r in cell]
            dense = [float(r["dense"]) for r in cell]
            diffs = [j - d for j, d in zip(job, dense)]
            spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
            print(f"{dataset:14s} {eps:5g} {len(cell):2d}  {statistics.mean(job):.4f} ± {spread(job):.4f}  "
                  f"{statistics.mean(dense):.4f} ± {spread(dense):.4f}  {statistics.mean(diffs):+.4f} ± "
                  f"{spread(diffs):.4f}")
            verdicts.append(statistics.mean(diffs) >= 0)
    print(f"\ntarget (mean paired difference ≥ 0 in every cell): {'met' if all(verdicts) else 'MISSED'} "
          f"({sum(verdicts)} of {len(verdicts)} cells)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
