"""DP feature selection for the ScatterNet linear head, measured: does a mask fitted to the private data pay?

A private ticket with `--prune inputs` (dpltm.tickets.private): a DP warm-up of the dense head on the private
data, then only the k input features whose DP weights have the largest column norm are kept (post-processing of
the warm-up's release), and DP training goes on from the masked warm-up weights; one σ covers warm-up and
training (the same total steps as the dense baseline, so the same σ). The noise then lives on 10·k weights
instead of 10·3969, and every record's gradient loses the dropped features (less clipping).

This script runs that mechanism and the dense baseline side by side in closed form (a linear head's per-record
gradient is (softmax − onehot) ⊗ [x, 1], so its norm is exact and cheap): Poisson sampling at q = L/N, clipping
to C, Gaussian noise σC on the summed gradients, SGD with momentum 0.9 at lr = 1/σ, σ calibrated by dpltm's PLD
accountant for (q, T, ε, δ) — the `scatter` recipe (L = 4096, 40 epochs, clip 1) on the grid's 54000 training
records. Its dense rows reproduce the grid's dense DP-SGD rows (docs/results.md), which checks it against the
product's own engine.

    python benchmarks/feature_selection_head.py --datasets mnist fashion-mnist --eps 0.2 1 --ks 512 1024 2048
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_recipe import positive_float, scatter_features  # noqa: E402

from dpltm.data import load_dataset  # noqa: E402
from dpltm.privacy.calibration import calibrate_noise_multiplier  # noqa: E402
from dpltm.privacy.display import format_sigma  # noqa: E402

BATCH, EPOCHS, CLIP, MOMENTUM, DELTA, N_TRAIN = 4096, 40, 1.0, 0.9, 1e-5, 54000


def dp_head(x: Tensor, y: Tensor, sigma: float, steps: int, generator: torch.Generator, weights: Tensor | None = None,
            columns: Tensor | None = None) -> Tensor:
    """`steps` of DP-SGD of a linear head (10 × (d + 1), bias last) from `weights` (zeros: the head's θ0), only the
    input features in `columns` kept (masked in the records, the gradients and the noise alike)."""
    n, d = x.shape
    rows = torch.cat([x, torch.ones(n, 1)], 1)
    keep = torch.ones(d + 1) if columns is None else torch.cat([columns.float(), torch.ones(1)])
    w = (torch.zeros(10, d + 1) if weights is None else weights) * keep
    velocity = torch.zeros_like(w)
    for _ in range(steps):
        batch = (torch.rand(n, generator=generator) < BATCH / n).nonzero().squeeze(1)
        xb = rows[batch] * keep
        residual = torch.softmax(xb @ w.T, 1)
        residual[torch.arange(len(batch)), y[batch]] -= 1
        scale = (CLIP / (residual.norm(dim=1) * xb.norm(dim=1) + 1e-12)).clamp(max=1.0)  # exact per-record norms
        noisy = (residual * scale[:, None]).T @ xb + sigma * CLIP * torch.randn(w.shape, generator=generator)
        velocity = MOMENTUM * velocity + noisy * keep / BATCH
        w = w - velocity / sigma  # lr = 1/σ: the recipe's lr_sigma = 1
    return w


def accuracy(w: Tensor, x: Tensor, y: Tensor) -> float:
    return float(((torch.cat([x, torch.ones(len(x), 1)], 1) @ w.T).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist", "fashion-mnist"])
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[0.2, 1.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[512, 1024, 2048],
                        help="input features kept (of 3969)")
    parser.add_argument("--warmup-epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.datasets:
        splits = scatter_features(load_dataset(name, split="train", seed=0, device="cpu"))
        x, y = splits.train.features.float()[:N_TRAIN], splits.train.labels[:N_TRAIN]
        test_x, test_y = splits.test.features.float(), splits.test.labels
        per_epoch = math.ceil(len(y) / BATCH)
        steps, warmup = EPOCHS * per_epoch, args.warmup_epochs * per_epoch
        for eps in args.eps:
            sigma = calibrate_noise_multiplier(BATCH / len(y), steps, eps, DELTA)  # PLD, add/remove
            for k in [0, *args.ks]:  # 0: the dense head
                started, scores = time.time(), []
                for seed in args.seeds:
                    generator = torch.Generator().manual_seed(1000 + seed)
                    if k == 0:
                        w = dp_head(x, y, sigma, steps, generator)
                    else:
                        w = dp_head(x, y, sigma, warmup, generator)
                        columns = torch.zeros(x.shape[1], dtype=torch.bool)
                        columns[w[:, :-1].norm(dim=0).topk(k).indices] = True  # the DP weights' strongest features
                        w = dp_head(x, y, sigma, steps - warmup, generator, weights=w, columns=columns)
                    scores.append(accuracy(w, test_x, test_y))
                spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
                label = "dense head" if k == 0 else f"k = {k} features by DP warm-up ({args.warmup_epochs} epochs)"
                print(f"{name} ε={eps:g} σ={format_sigma(sigma)} {label}: {statistics.mean(scores):.4f} ± "
                      f"{spread:.4f} {[round(s, 4) for s in scores]} ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
