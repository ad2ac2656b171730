"""Is Tramèr & Boneh's private data normalisation worth building? An upper bound, NOT a DP result.

Tramèr & Boneh (ICLR 2021, §3 and their `dp_utils.scatter_normalization`) standardise each of the 81 scattering
maps by its mean and variance over the *private* training set, released with Gaussian noise and composed into ε,
in place of per-record group normalisation. Before paying ε for those statistics, this bounds what they can
give: the statistics here are computed **exactly and without noise** from the private training records, so
the `datanorm` rows are not differentially private (the DP-SGD part alone is; its ε is what is printed). If
free, exact statistics do not lift the linear head, a noisy release of them cannot either.

Rows: `gn` (the front end as shipped: per-record group normalisation, 27 groups) and `datanorm` (the raw
scattering maps standardised per map by the private set's exact statistics, rescaled to the `gn` features'
mean record norm so clip 1 keeps its meaning). The head is trained by `make_private` under the `scatter`
recipe (pca_head.train_head: L = 4096, 40 epochs, momentum 0.9, clip 1, PLD, δ = 1e-5) at each lr·σ given.

    python benchmarks/private_norm_oracle.py --datasets mnist fashion-mnist --eps 1 --lr-sigmas 1 2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pca_head import BATCH, train_head  # noqa: E402
from tune_recipe import positive_float  # noqa: E402

from dpltm.data import load_dataset  # noqa: E402
from dpltm.errors import DpltmUserError  # noqa: E402
from dpltm.networks.scatter import GROUPS, NORM_EPS, ScatterFront  # noqa: E402


@torch.no_grad()
def raw_maps(front: ScatterFront, records: Tensor) -> Tensor:
    """The scattering maps (N, 81, side/4, side/4) before any normalisation."""
    parts = []
    for part in records.split(2048):
        images = part.reshape(part.shape[0], front.side, front.side).float()
        parts.append(front._transform(part.device)(images).reshape(part.shape[0], *front.out_shape))
    return torch.cat(parts)


def group_normalised(maps: Tensor) -> Tensor:
    """What the shipped front end gives (ScatterFront.forward)."""
    return F.group_norm(maps, GROUPS, eps=NORM_EPS).flatten(1)


def map_standardised(maps: Tensor, reference: Tensor) -> Tensor:
    """Each map standardised by its mean and standard deviation over `reference` (all records, all positions)."""
    mean = reference.mean((0, 2, 3), keepdim=True)
    std = reference.std((0, 2, 3), keepdim=True)
    return ((maps - mean) / (std + 1e-5)).flatten(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist"])
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[1.0])
    parser.add_argument("--lr-sigmas", type=positive_float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    try:
        run(args)
    except DpltmUserError as error:
        parser.exit(2, f"private_norm_oracle.py: {error}\n")


def run(args: argparse.Namespace) -> None:
    for name in args.datasets:
        data = load_dataset(name, split="train", seed=0, device="cpu")
        front = ScatterFront(data.num_features)
        train_maps, test_maps = raw_maps(front, data.train.features), raw_maps(front, data.test.features)
        shipped = group_normalised(train_maps), group_normalised(test_maps)
        norm = shipped[0].norm(dim=1).mean()
        oracle = map_standardised(train_maps, train_maps), map_standardised(test_maps, train_maps)
        gain = norm / oracle[0].norm(dim=1).mean()
        variants = {"gn": shipped, "datanorm (exact private statistics: NOT DP)": (oracle[0] * gain, oracle[1] * gain)}
        for eps in args.eps:
            for label, (train, test) in variants.items():
                for lr_sigma in args.lr_sigmas:
                    started = time.time()
                    runs = [train_head((train, data.train.labels), (test, data.test.labels), eps=eps, sigma=None,
                                       batch=BATCH, lr_sigma=lr_sigma, seed=seed) for seed in args.seeds]
                    accs = [r[0] for r in runs]
                    spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
                    print(f"{name} ε(DP-SGD)={eps:g} {label} lr·σ={lr_sigma:g}: {statistics.mean(accs):.4f} ± "
                          f"{spread:.4f} {[round(a, 4) for a in accs]} ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
