"""A noise-reduction lever, measured: DOPPLER's low-pass filter over the noisy gradients (dpltm.dp.noise_filter) on the
ScatterNet linear head.

The head (zero-initialised, 3969 scattering features → 10 classes) is trained with dpltm's `make_private` under the
`scatter` recipe (L = 4096, 40 epochs, SGD momentum 0.9, lr = 1/σ, clip 1, δ = 1e-5, Poisson sampling, PLD), on the
private training split, and scored on its test split; each row is one way of stepping on the noisy gradients:

* dense: the recipe as it is (the baseline, trained in the same run on the same seeds);
* doppler + momentum 0.9: the filter's output fed to the recipe's optimiser;
* doppler, momentum 0: the paper's LP-DPSGD (the filter replaces momentum: θ ← θ − η m̂), at the recipe's lr = 1/σ;
* doppler, momentum 0, lr = 10/σ: the same, at the step size momentum 0.9 gives the recipe in the steady state (heavy
  ball's gain at frequency 0 is 1/(1 − β) = 10; the filter's is 1). Derived, not tuned: no other lr is tried.

The filter is post-processing of the released gradients: every row spends the same ε (printed). Nothing is chosen on
the test split: the filter is the paper's preset, the recipe the one chosen on public data.

    OMP_NUM_THREADS=1 python benchmarks/noise_filter_head.py --datasets mnist fashion-mnist --eps 1 0.2 --seeds 0 1 2
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
from tune_recipe import positive_float, scatter_features  # noqa: E402

from dpltm.api import make_private  # noqa: E402
from dpltm.data import load_dataset  # noqa: E402
from dpltm.errors import DpltmUserError  # noqa: E402
from dpltm.privacy.display import format_epsilon  # noqa: E402

BATCH, EPOCHS, CLIP, DELTA = 4096, 40, 1.0, 1e-5

VARIANTS = {  # name: (noise filter, momentum, lr·σ)
    "dense": ("none", 0.9, 1.0),
    "doppler+momentum0.9": ("doppler", 0.9, 1.0),
    "doppler,momentum0": ("doppler", 0.0, 1.0),
    "doppler,momentum0,lr10/σ": ("doppler", 0.0, 10.0),
}


def train_head(train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], *, eps: float, seed: int,
               noise_filter: str, momentum: float, lr_sigma: float) -> tuple[float, float]:
    """(test accuracy, ε spent) of a zero-initialised linear head trained with `make_private` at lr = lr_sigma / σ."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(train[0].shape[1], 10)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    optimizer = torch.optim.SGD(head.parameters(), lr=1.0, momentum=momentum)
    run = make_private(head, optimizer, train, target_epsilon=eps, delta=DELTA, epochs=EPOCHS, batch_size=BATCH,
                       max_grad_norm=CLIP, noise_seed=seed, noise_filter=noise_filter)
    for group in optimizer.param_groups:
        group["lr"] = lr_sigma / run.plan.noise_multiplier
    run.fit()
    return run.evaluate(test), run.epsilon


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist", "fashion-mnist"])
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    if "dense" not in args.variants:
        args.variants = ["dense", *args.variants]  # the baseline is always run beside the others
    try:
        run(args)
    except DpltmUserError as error:  # a missing data file, say: one line
        parser.exit(2, f"noise_filter_head.py: {error}\n")


def run(args: argparse.Namespace) -> None:
    for name in args.datasets:
        private = scatter_features(load_dataset(name, split="train", seed=0, device="cpu"))
        train = (private.train.features, private.train.labels)
        test = (private.test.features, private.test.labels)
        for eps in args.eps:
            started = time.time()
            dense: list[float] = []
            for variant in args.variants:
                noise_filter, momentum, lr_sigma = VARIANTS[variant]
                runs = [train_head(train, test, eps=eps, seed=s, noise_filter=noise_filter, momentum=momentum,
                                   lr_sigma=lr_sigma) for s in args.seeds]
                accs = [r[0] for r in runs]
                dense = accs if variant == "dense" else dense
                spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
                paired = [a - d for a, d in zip(accs, dense, strict=True)]
                print(f"{name} ε={eps} {variant}: {statistics.mean(accs):.4f} ± {spread:.4f} "
                      f"{[round(a, 4) for a in accs]}; paired vs dense {statistics.mean(paired):+.4f}; ε spent "
                      f"{format_epsilon(max(r[1] for r in runs))}", flush=True)
            print(f"# {name} ε={eps}: {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
