"""A lever for issue 25, measured: public affine maps of the scattering features before a DP linear head.

Each map is fitted on *public* features only (KMNIST's test split; no private record is read, so the map costs no
privacy, like the front end itself):
* `none` — the features as the front end gives them (per-record group normalisation);
* `std-feature` — each of the 3969 features standardised by its public mean and standard deviation;
* `std-channel` — each of the 81 scattering maps standardised by its public mean and standard deviation;
* `pcaK` — centred by the public mean and projected onto the top K public principal directions;
* `std-pcaK` — standardised per feature, then projected onto the top K principal directions of that.
Every map is rescaled so that the mean public record norm is unchanged (the clip norm keeps its meaning). lr·σ is
chosen per map among 0.25–2 by the TAN proxy of `pca_head.py` (the public split's training records at the private
run's sampling rate, noise per step and steps; 2 proxy seeds; scored on its validation records); then the head is
trained with `make_private` on the private training split (the `scatter` recipe otherwise: L = 4096, 40 epochs,
SGD momentum 0.9, clip 1, PLD, δ = 1e-5) and scored on the test split.

    python benchmarks/public_feature_maps.py --datasets mnist --eps 1 0.2 --maps none std-feature pca1024 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pca_head import BATCH, CLIP, DELTA, EPOCHS, train_head  # noqa: E402
from tune_recipe import positive_float, scatter_features  # noqa: E402

from dpltm.api import make_private  # noqa: E402
from dpltm.data import load_dataset  # noqa: E402
from dpltm.errors import DpltmUserError  # noqa: E402
from dpltm.privacy.display import format_epsilon  # noqa: E402

CHANNELS, POSITIONS = 81, 49  # J = 2 scattering of a 28×28 image: 81 maps of 7×7


class PublicMap:
    """x ↦ ((x − μ) / s) [V_k]: a map fitted on public features only (see the module docstring)."""

    def __init__(self, public: Tensor, kind: str) -> None:
        self.kind, self.basis = kind, None
        x = public.double()
        self.mean = torch.zeros(x.shape[1], dtype=torch.float64)
        self.scale = torch.ones(x.shape[1], dtype=torch.float64)
        if kind == "none":
            return
        if kind == "std-channel":
            maps = x.reshape(-1, CHANNELS, POSITIONS)
            self.mean = maps.mean((0, 2)).repeat_interleave(POSITIONS)
            self.scale = maps.std((0, 2)).repeat_interleave(POSITIONS).clamp(min=1e-6)
        elif kind == "std-feature" or kind.startswith("std-pca"):
            self.mean, self.scale = x.mean(0), x.std(0).clamp(min=1e-3)
        elif kind.startswith("pca"):
            self.mean = x.mean(0)
        else:
            raise DpltmUserError(f"unknown map {kind!r}")
        z = (x - self.mean) / self.scale
        if "pca" in kind:
            k = int(kind.split("pca")[1])
            if not 0 < k <= x.shape[1]:
                raise DpltmUserError(f"{kind}: k must lie in 1..{x.shape[1]}")
            _, _, v = torch.linalg.svd(z, full_matrices=False)
            self.basis = v[:k].T.contiguous()
            z = z @ self.basis
        self.gain = float(x.norm(dim=1).mean() / z.norm(dim=1).mean())

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "none":
            return x.float()
        out = []
        for part in x.split(8192):  # bounded memory: float64 only per piece
            z = (part.double() - self.mean) / self.scale
            out.append(((z @ self.basis) if self.basis is not None else z).mul_(self.gain).float())
        return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist"])
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--maps", nargs="+", default=["none", "std-feature", "pca1024"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr-sigmas", type=positive_float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    args = parser.parse_args(argv)
    try:
        run(args)
    except DpltmUserError as error:
        parser.exit(2, f"public_feature_maps.py: {error}\n")


def run(args: argparse.Namespace) -> None:
    public = scatter_features(load_dataset("kmnist", split="test", seed=0, device="cpu"))
    pub_x, pub_y = public.train.features, public.train.labels
    held_x, held_y = public.val.features, public.val.labels
    maps = {kind: PublicMap(pub_x, kind) for kind in args.maps}
    for name in args.datasets:
        private = scatter_features(load_dataset(name, split="train", seed=0, device="cpu"))
        proxy_batch = max(1, round(BATCH * len(pub_y) / len(private.train.labels)))
        for eps in args.eps:
            probe = torch.nn.Linear(1, 10)
            sigma = make_private(probe, torch.optim.SGD(probe.parameters(), lr=1.0),
                                 (private.train.features[:, :1], private.train.labels), target_epsilon=eps,
                                 delta=DELTA, epochs=EPOCHS, batch_size=BATCH, max_grad_norm=CLIP,
                                 noise_seed=0).plan.noise_multiplier
            for kind, fitted in maps.items():
                started = time.time()
                proxy_train, proxy_val = (fitted(pub_x), pub_y), (fitted(held_x), held_y)
                scores = {lr: statistics.mean(
                    train_head(proxy_train, proxy_val, eps=None, sigma=sigma * proxy_batch / BATCH,
                               batch=proxy_batch, lr_sigma=lr, seed=100 + s, lr_for=sigma)[0] for s in range(2))
                    for lr in args.lr_sigmas}
                best = max(scores, key=scores.__getitem__)
                train = (fitted(private.train.features), private.train.labels)
                test = (fitted(private.test.features), private.test.labels)
                runs = [train_head(train, test, eps=eps, sigma=None, batch=BATCH, lr_sigma=best, seed=s)
                        for s in args.seeds]
                accs = [r[0] for r in runs]
                spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
                print(f"{name} ε={eps:g} {kind}: proxy {', '.join(f'{lr:g}: {v:.4f}' for lr, v in scores.items())} "
                      f"→ lr·σ={best:g}: {statistics.mean(accs):.4f} ± {spread:.4f} {[round(a, 4) for a in accs]} "
                      f"ε spent ≤ {format_epsilon(max(r[1] for r in runs))} ({time.time() - started:.0f} "
                      f"s)", flush=True)


if __name__ == "__main__":
    main()
