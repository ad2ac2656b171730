"""Choose the DP-SGD recipe on public data only: the search behind `benchmarks/grid/profiles/tuned.yaml`.

    python benchmarks/tune_recipe.py --public kmnist:test --private-size 54000 --eps 1 0.25 \\
        --out docs/recipe_search.csv

For each recipe (activation, expected batch L, epochs, learning rate) and each ε, σ is
calibrated exactly as the private run would calibrate it (q = L/N for the private set's size N,
which dpltm treats as public, T = epochs·⌈N/L⌉ steps, PLD at δ), and the dense network is trained
by that DP-SGD — same σ, L, T and clip, so the same noise per step σC/L — on the *public* data's
training part; the score is accuracy on the public data's own validation part. Learning rates
share one run (a stack of identical networks, one per rate, on common Poisson batches), and
the EMA of the iterates is scored at several decays in the same run (post-processing: free).
No private record is read: only the private set's size enters, through q and T.

`--proxy same-rate` samples the public set at the private run's rate q instead (the TAN proxy:
expected batch q·n, σ scaled to keep σC/L; benchmarks/grid/recipe_search.py), so batches larger
than the public set can be searched; `--lr-sigmas` gives the rates as lr·σ, the recipes'
`lr_sigma`; `--seeds` repeats each recipe and the summary line takes the mean over them.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from grid.recipe_search import FIELDS, PROXIES, PROXY_FIELDS, search_recipe

from dpltm.data import load_dataset
from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import ARCH_DEFAULT_HIDDEN


def scatter_features(public: DatasetSplits) -> DatasetSplits:
    """`public` as scatter-linear's head reads it: its records' scattering features (dpltm.feature_cache)."""
    from dpltm.feature_cache import network_inputs
    from dpltm.networks.lenet import build_architecture, build_network

    net = build_network(build_architecture(public.num_features, public.num_classes, (), None, "relu",
                                           "scatter-linear"))
    return replace(network_inputs(net, public, progress=True), num_features=net.front.out_features)


def positive_int(text: str) -> int:
    """argparse type: a whole number ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def batch_epochs(text: str) -> tuple[int, int]:
    """argparse type: `LxE`, an expected batch size and a number of epochs, both ≥ 1."""
    parts = text.split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not LxE (e.g. 4096x40)")
    return positive_int(parts[0]), positive_int(parts[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", default="kmnist:test", help="public dataset[:split]")
    parser.add_argument("--private-size", type=positive_int, default=54000, help="N of the private training set")
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--delta", type=positive_float, default=1e-5)
    parser.add_argument("--activations", nargs="+", default=["relu", "tanh"])
    parser.add_argument("--batch-epochs", type=batch_epochs, nargs="+", default=[(400, 50), (1600, 50)],
                        help="expected batch size x epochs pairs")
    parser.add_argument("--lrs", type=positive_float, nargs="+", default=[0.1, 0.4, 1.6])
    parser.add_argument("--lr-sigmas", action="store_true",
                        help="--lrs are lr·σ (a recipe's lr_sigma): each rate is divided by the run's σ")
    parser.add_argument("--proxy", choices=PROXIES, default="public-batch",
                        help="public-batch: expected batch L on the public set; same-rate: the private run's "
                             "rate q = L/N on the public set, σ scaled to keep σC/L (TAN)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="repeat each recipe with these seeds (θ0 and noise); the summary is their mean")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--clip", type=positive_float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="mlp",
                        help="the network (dpltm's --arch: mlp, lenet5, scatter-cnn; the linear head: --front scatter)")
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        help="hidden layer widths (default: the architecture's own: 300 100 for mlp, 120 84 for "
                             "lenet5, 32 for scatter-cnn)")
    parser.add_argument("--front", choices=["scatter"], default=None,
                        help="search the linear head over a fixed front end's features (--arch scatter-linear): "
                             "the public records' cached features, no hidden layer")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="append rows to this CSV")
    args = parser.parse_args(argv)
    name, split = (args.public.split(":", 1) + ["train"])[:2]
    public = load_dataset(name, split=split, data_dir=args.data_dir, val_fraction=0.1, seed=args.seed)
    scatter_head = args.arch.startswith("scatter-") and args.arch != "scatter-cnn"
    if scatter_head or (args.front is not None and args.arch != "mlp"):
        parser.error("a ScatterNet linear head is searched with --front scatter and --arch mlp (a linear head over "
                     "the scattering features), its CNN head with --arch scatter-cnn; --arch names an image network "
                     "(mlp, lenet5) otherwise")
    if args.hidden is None:
        args.hidden = list(ARCH_DEFAULT_HIDDEN.get(args.arch, (300, 100)))  # the architecture's own widths
    if args.front is not None:  # the head's own inputs: the front end's features, computed once (cached)
        public = scatter_features(public)
        args.hidden = []
    print(f"public data: {public.name} ({public.source_split}): {len(public.train)} train, {len(public.val)} val; "
          f"private N = {args.private_size} (size only)", file=sys.stderr)
    fields = FIELDS + PROXY_FIELDS
    writer = None
    if args.out is not None:
        if args.out.exists():
            with args.out.open(newline="") as existing:
                header = next(csv.reader(existing), None)
            if header is not None and header != fields:
                parser.error(f"{args.out} has other columns (written by another version); choose a new --out")
        new = not args.out.exists() or args.out.stat().st_size == 0
        handle = args.out.open("a", newline="")
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new:
            writer.writeheader()
    seeds = args.seeds if args.seeds is not None else [args.seed]
    for eps, activation, (batch, epochs) in itertools.product(args.eps, args.activations, args.batch_epochs):
        rows, start = [], time.perf_counter()
        for seed in seeds:
            try:
                rows += search_recipe(public, args.private_size, eps, args.delta, activation, batch, epochs,
                                      args.lrs, args.momentum, args.clip, seed, tuple(args.hidden), args.proxy,
                                      args.lr_sigmas, args.arch)
            except (ValueError, DpltmUserError) as error:
                parser.error(str(error))
        best, mean, spread = best_setting(rows)
        print(f"ε={eps:g} {args.arch} {activation} L={batch} E={epochs} σ={rows[0]['sigma']} "
              f"(proxy L'={rows[0]['proxy_batch']}, "
              f"σ'={rows[0]['proxy_sigma']}): best lr·σ={best[0]} ema={best[1] or 'off'}{' warm-up' * best[2]} "
              f"public val {mean:.4f}"
              f" ± {spread:.4f} over {len(seeds)} seed(s) ({time.perf_counter() - start:.0f} s)", flush=True)
        if writer is not None:
            writer.writerows(rows)
            handle.flush()


def best_setting(rows: list[dict[str, Any]]) -> tuple[tuple[Any, Any, bool], float, float]:
    """The (lr·σ, EMA decay, warm-up) with the best mean public validation accuracy over seeds, that mean,
    and the standard error of the mean (0 for one seed)."""
    scores: dict[tuple[Any, Any, bool], list[float]] = defaultdict(list)
    for row in rows:
        scores[(row["lr_sigma"], row["ema"], bool(row.get("ema_warmup")))].append(float(row["public_val_accuracy"]))
    best = max(scores, key=lambda key: statistics.fmean(scores[key]))
    values = scores[best]
    spread = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return best, statistics.fmean(values), spread


if __name__ == "__main__":
    main()
