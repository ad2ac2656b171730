"""A DP-SGD recipe chosen on public data only (issue 9): the search behind the `tuned` profile.

For each recipe (activation, expected batch L, epochs, learning rate) and ε, σ is calibrated
exactly as the private run would calibrate it — q = L/N for the private set's size N (which
dpltm treats as public), T = epochs·⌈N/L⌉ steps, PLD at δ — and the dense network is trained by
that DP-SGD (same σ, L, T and clip, so the same noise per step σC/L) on the *public* data's
training part; the score is accuracy on the public data's own validation part. Learning rates
share one run (a stack of identical networks, one per rate, on common Poisson batches), and the
EMA of the iterates is scored at several decays, with and without a warm-up, in the same run
(post-processing: free), by the private run's own averaging rule (dpltm.dp.averaging).

Two proxies for the private run's batches. `public-batch` (the default) samples the expected batch L
itself from the public training part, so L cannot exceed it. `same-rate` is the TAN proxy of
Sander et al. (ICML 2023, "TAN without a burn", §3): the public set is sampled at the private run's
rate q = L/N, so the expected batch is L' = q·n, and σ' = σ·L'/L keeps the noise per step σ'C/L' equal
to the private run's σC/L over the same T steps; it matches the private run's epochs too, and it
reaches batches far larger than the public set.

A network over a fixed front end (`arch="scatter-cnn"`, ScatterNet's CNN head) trains on the public records'
cached front-end features (dpltm.feature_cache), as `dpltm train` does.

A convolutional network (`arch="lenet5"`, `"scatter-cnn"`) cannot be stacked into one set of matrices: its
candidates, one per rate, are stepped in turn by the DP training's own step (`EachCandidate`, the noise-aware choice's
path for CNNs) on the same Poisson batches, each with its own noise draw and its own SGD rate.

Nothing here takes private data: `search_recipe` gets the public splits and one integer, N.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dpltm.data.types import DatasetSplits
from dpltm.dp.averaging import Ema, average_into
from dpltm.dp.batched import StackedMLP, accuracies, noisy_step
from dpltm.dp.sampling import poisson_sample
from dpltm.feature_cache import network_inputs
from dpltm.masks import full_masks
from dpltm.networks.lenet import build_architecture, build_network
from dpltm.privacy.calibration import calibrate_noise_multiplier
from dpltm.selection.noise_aware import EachCandidate, PlannedRun, stacks, tan_proxy

AVERAGES = (None, Ema(0.99), Ema(0.995), Ema(0.999), Ema(0.99, warmup=True), Ema(0.999, warmup=True))
"""The released weights scored: the final iterate and EMAs, as `train --ema D [--ema-warmup]` releases them."""
FIELDS = ["epsilon", "activation", "batch_size", "epochs", "lr", "ema", "sigma", "steps", "public_val_accuracy",
          "seconds"]
PROXY_FIELDS = ["proxy", "proxy_batch", "proxy_sigma", "lr_sigma", "momentum", "seed", "ema_warmup"]
PROXIES = ("public-batch", "same-rate")


def proxy_batch(proxy: str, batch: int, private_size: int, public_size: int, sigma: float) -> tuple[float, float]:
    """The expected batch and noise multiplier a proxy run on `public_size` records uses for a private
    run of expected batch `batch` over `private_size` records at noise multiplier `sigma`.

    Both keep σC/L, the noise per step relative to the averaged gradient (TAN, Sander et al. 2023, §3);
    `same-rate` is the noise-aware choice's epoch-matched proxy (`tan_proxy`), without rounding the batch.
    """
    if proxy == "public-batch":
        if batch > public_size:
            raise ValueError(f"the public-batch proxy samples L = {batch} from {public_size} public records; "
                             f"use the same-rate proxy for batches above the public set's size")
        return float(batch), sigma
    if proxy == "same-rate":
        return tan_proxy(batch, sigma, private_size, public_size)
    raise ValueError(f"unknown proxy {proxy!r}: one of {', '.join(PROXIES)}")


class PerCandidateSGD:
    """SGD (with momentum) whose learning rate differs along the stack's candidate axis: the gradient
    of candidate k is scaled by lr_k and a lr-1 SGD steps it (momentum is linear, so this is exactly
    K SGD optimisers with rates lr_k)."""

    def __init__(self, params: list[torch.Tensor], lrs: torch.Tensor, momentum: float) -> None:
        self.params, self.lrs = params, lrs
        self.inner = torch.optim.SGD(params, lr=1.0, momentum=momentum)

    def step(self) -> None:
        for p in self.params:
            assert p.grad is not None
            p.grad.mul_(self.lrs.view(-1, *([1] * (p.dim() - 1))))
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def search_recipe(public: DatasetSplits, private_size: int, eps: float, delta: float, activation: str, batch: int,
                  epochs: int, lrs: list[float], momentum: float = 0.0, clip: float = 1.0, seed: int = 0,
                  hidden: tuple[int, ...] = (300, 100), proxy: str = "public-batch",
                  lr_sigmas: bool = False, arch: str = "mlp") -> list[dict[str, Any]]:
    """One (activation, L, epochs) recipe at every rate in `lrs` and every EMA decay: one row each.

    With `lr_sigmas`, `lrs` are lr·σ (the recipes' `lr_sigma`): each run's rate is lr_sigma/σ for the
    private run's σ, as `dpltm train` sets it. `arch`: the network (`--arch`; an MLP stacks, a CNN steps
    its candidates in turn).
    """
    start = time.perf_counter()
    q = batch / private_size
    steps = -(-private_size // batch) * epochs
    sigma = calibrate_noise_multiplier(q, steps, eps, delta)
    n = len(public.train)
    expected, proxy_sigma = proxy_batch(proxy, batch, private_size, n, sigma)
    rates = [lr / sigma for lr in lrs] if lr_sigmas else list(lrs)
    architecture = build_architecture(public.num_features, public.num_classes, hidden, None, activation, arch)
    models = [build_network(architecture, torch.Generator().manual_seed(seed)) for _ in lrs]  # same θ0 each rate
    public = network_inputs(models[0], public)  # a fixed front end's cached features; the records otherwise
    x_all, y_all = public.train.features, public.train.labels
    stack: StackedMLP | EachCandidate
    optimizer: PerCandidateSGD | torch.optim.Optimizer
    if stacks(models[0]):
        stack = StackedMLP(models, [full_masks(model) for model in models])
        optimizer = PerCandidateSGD(stack.parameters(), torch.tensor(rates), momentum)
    else:
        plan = PlannedRun(noise_multiplier=proxy_sigma, expected_batch_size=expected, steps=steps,  # type: ignore[arg-type]
                          clip=clip, lr=1.0, momentum=momentum)  # the proxy's (possibly fractional) L'
        stack = EachCandidate(models, [full_masks(model) for model in models], plan, x_all.dtype)
        stack.use_records(x_all)
        optimizer = torch.optim.SGD([{"params": list(model.parameters()), "lr": rate}
                                     for model, rate in zip(models, rates)], lr=rates[0], momentum=momentum)
    generator = torch.Generator().manual_seed(seed + 1)
    parameters = stack.parameters()
    averages = {ema: [torch.zeros_like(p) for p in parameters] for ema in AVERAGES if ema is not None}
    counts = {ema: torch.zeros((), dtype=torch.long) for ema in averages}  # EMA_1 = θ_1, as the private run
    for _ in range(steps):
        index = poisson_sample(n, expected / n, generator, x_all.device)
        x, y = x_all.index_select(0, index), y_all.index_select(0, index)
        if isinstance(stack, EachCandidate):
            stack.step(optimizer, x, y, generator, index)  # type: ignore[arg-type]
        else:
            noisy_step(stack, optimizer, x, y, clip=clip,  # type: ignore[arg-type]
                       noise_multiplier=proxy_sigma, expected_batch_size=expected, generator=generator)
        for ema, mean in averages.items():
            average_into(mean, [p.detach() for p in parameters], counts[ema], ema)
    rows = []
    final = [p.detach().clone() for p in stack.parameters()]
    for ema in AVERAGES:
        with torch.no_grad():
            for p, v in zip(stack.parameters(), final if ema is None else averages[ema]):
                p.copy_(v)
        val_x, val_y = public.val.features, public.val.labels
        scores = (stack.correct(val_x, val_y).double().mean(dim=1).tolist() if isinstance(stack, EachCandidate)
                  else accuracies(stack, val_x, val_y).tolist())
        for lr, rate, score in zip(lrs, rates, scores):
            rows.append({"epsilon": eps, "activation": activation, "batch_size": batch, "epochs": epochs,
                         "lr": round(rate, 6), "ema": "" if ema is None else ema.decay, "sigma": round(sigma, 5),
                         "steps": steps, "public_val_accuracy": round(score, 4),
                         "seconds": round(time.perf_counter() - start, 1), "proxy": proxy,
                         "proxy_batch": round(expected, 1), "proxy_sigma": round(proxy_sigma, 5),
                         "lr_sigma": lr if lr_sigmas else round(rate * sigma, 4), "momentum": momentum,
                         "seed": seed, "ema_warmup": ema is not None and ema.warmup})
    return rows
