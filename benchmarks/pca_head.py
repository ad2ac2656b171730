"""A lever for issue 25, measured: a DP linear head over a *public* PCA subspace of the scattering features.

The scattering front end (kymatio, J = 2, per-record group normalisation) gives 3969 features per image;
a DP linear head over them pays noise on 39 700 weights. Projecting the features onto the top k principal
directions of *public* features (KMNIST's test split: no private record is read to fit them, so the
projection costs no privacy, like the front end itself) leaves a head of 10·(k + 1) weights.

k and the step size are chosen on public data only, by a TAN proxy (Sander et al. 2023): the PCA fitted on
the public split's training records, a head trained on them with the private run's sampling rate q, steps T,
step size and noise on the mean gradient (σ' / L' = σ / L, with σ what ε, δ, q and T give the private run),
scored on its validation records. Then the chosen k and the baseline
(k = 0: no projection, the `scatter` recipe: L = 4096, 40 epochs, SGD momentum 0.9, lr = 1/σ, clip 1) are
trained on the private training split with dpltm's `make_private` (Poisson sampling, PLD accounting,
δ = 1e-5) over several seeds and scored on its test split.

    python benchmarks/pca_head.py --datasets mnist fashion-mnist --eps 1 0.2 --seeds 0 1 2
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
from dpltm.privacy.display import format_epsilon, format_sigma  # noqa: E402

BATCH, EPOCHS, CLIP, MOMENTUM, DELTA = 4096, 40, 1.0, 0.9, 1e-5
FEATURES = 81 * 7 * 7  # J = 2 scattering of a 28×28 image


class PublicProjection:
    """x ↦ (x − μ) V_k: the top-k principal directions of public features (k = 0: x unchanged)."""

    def __init__(self, public: Tensor, k: int) -> None:
        self.k = k
        self.mean = public.double().mean(0)
        if k:
            _, _, v = torch.linalg.svd(public.double() - self.mean, full_matrices=False)
            self.basis = v[:k].T.contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        return x.float() if not self.k else ((x.double() - self.mean) @ self.basis).float()


def train_head(train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], *, eps: float | None, sigma: float | None,
               batch: int, lr_sigma: float, seed: int, lr_for: float | None = None) -> tuple[float, float, float]:
    """(test accuracy, ε spent, σ) of a zero-initialised linear head trained with `make_private` at lr = lr·σ / σ
    (σ the run's own, or `lr_for`: the private run's, which a proxy mimics)."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(train[0].shape[1], 10)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    optimizer = torch.optim.SGD(head.parameters(), lr=1.0, momentum=MOMENTUM)
    run = make_private(head, optimizer, train, target_epsilon=eps, noise_multiplier=sigma, delta=DELTA,
                       epochs=EPOCHS, batch_size=batch, max_grad_norm=CLIP, noise_seed=seed)
    for group in optimizer.param_groups:
        group["lr"] = lr_sigma / (lr_for or run.plan.noise_multiplier)
    run.fit()
    return run.evaluate(test), run.epsilon, run.plan.noise_multiplier


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=["mnist", "fashion-mnist"], default=["mnist", "fashion-mnist"],
                        help="private datasets (KMNIST is the public one)")
    parser.add_argument("--eps", type=positive_float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 128, 256, 512, 1024],
                        help="projection sizes the public proxy chooses among (0: none; at most 3969, the features)")
    parser.add_argument("--lr-sigmas", type=positive_float, nargs="+", default=[0.5, 1.0, 2.0])
    args = parser.parse_args(argv)
    if any(not 0 <= k <= FEATURES for k in args.ks):
        parser.error(f"--ks: each projection size must lie in 0..{FEATURES} (the scattering features)")
    try:
        run(args)
    except DpltmUserError as error:  # a missing data file, say: one line
        parser.exit(2, f"pca_head.py: {error}\n")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    public = scatter_features(load_dataset("kmnist", split="test", seed=0, device="cpu"))
    pub_x, pub_y = public.train.features, public.train.labels  # fits the PCA and the proxy's heads
    held_x, held_y = public.val.features, public.val.labels  # scores the proxy's heads
    for name in args.datasets:
        private = scatter_features(load_dataset(name, split="train", seed=0, device="cpu"))
        n = len(private.train.labels)
        proxy_batch = max(1, round(BATCH * len(pub_y) / n))  # the private run's sampling rate q
        for eps in args.eps:
            started = time.time()
            # σ for the private run's (q, T, ε, δ): the plan `make_private` makes (nothing is trained)
            probe = torch.nn.Linear(1, 10)
            sigma = make_private(probe, torch.optim.SGD(probe.parameters(), lr=1.0),
                                 (private.train.features[:, :1], private.train.labels), target_epsilon=eps,
                                 delta=DELTA, epochs=EPOCHS, batch_size=BATCH, max_grad_norm=CLIP,
                                 noise_seed=0).plan.noise_multiplier
            scores: dict[tuple[int, float], float] = {}
            for k in args.ks:
                projection = PublicProjection(pub_x, k)
                proxy_train = (projection(pub_x), pub_y)
                proxy_val = (projection(held_x), held_y)
                for lr_sigma in args.lr_sigmas:
                    accs = [train_head(proxy_train, proxy_val, eps=None, sigma=sigma * proxy_batch / BATCH,
                                       batch=proxy_batch, lr_sigma=lr_sigma, seed=100 + s, lr_for=sigma)[0]
                            for s in range(2)]
                    scores[(k, lr_sigma)] = statistics.mean(accs)
            k_best, lr_best = max(scores, key=scores.get)  # type: ignore[arg-type]
            base_lr = max((lr for k, lr in scores if k == 0), key=lambda lr: scores[(0, lr)])
            print(f"# {name} ε={eps}: σ={format_sigma(sigma)}; TAN proxy (KMNIST's test split: {len(pub_y)} "
                  f"records fit, "
                  f"{len(held_y)} score): " +
                  ", ".join(f"k={k} lr·σ={lr}: {v:.4f}" for (k, lr), v in sorted(scores.items())), flush=True)
            for k, lr_sigma, label in ((0, 1.0, "scatter recipe, no projection"),
                                       (0, base_lr, "no projection, lr chosen by the proxy"),
                                       (k_best, lr_best, "public PCA, k and lr chosen by the proxy")):
                projection = PublicProjection(pub_x, k)
                train = (projection(private.train.features), private.train.labels)
                test = (projection(private.test.features), private.test.labels)
                runs = [train_head(train, test, eps=eps, sigma=None, batch=BATCH, lr_sigma=lr_sigma, seed=s)
                        for s in args.seeds]
                accs = [r[0] for r in runs]
                spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
                print(f"{name} ε={eps} k={k} lr·σ={lr_sigma} ({label}): {statistics.mean(accs):.4f} ± {spread:.4f} "
                      f"{[round(a, 4) for a in accs]} ε spent ≤ {format_epsilon(max(r[1] for r in runs))}", flush=True)
            print(f"# {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
