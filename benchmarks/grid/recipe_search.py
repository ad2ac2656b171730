"""A DP-SGD recipe chosen on public data only (issue 9): the search behind the `tuned` profile.

For each recipe (activation, expected batch L, epochs, learning rate) and ε, σ is calibrated
exactly as the private run would calibrate it — q = L/N for the private set's size N (which
dpltm treats as public), T = epochs·⌈N/L⌉ steps, PLD at δ — and the dense network is trained by
that DP-SGD (same σ, L, T and clip, so the same noise per step σC/L) on the *public* data's
training part; the score is accuracy on the public data's own validation part. Learning rates
share one run (a stack of identical networks, one per rate, on common Poisson batches), and the
EMA of the iterates is scored at several decays in the same run (post-processing: free).

Nothing here takes private data: `search_recipe` gets the public splits and one integer, N.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dpltm.data.types import DatasetSplits
from dpltm.dp.batched import StackedMLP, accuracies, noisy_step
from dpltm.dp.sampling import poisson_sample
from dpltm.model import LeNet, build_architecture
from dpltm.privacy.calibration import calibrate_noise_multiplier

EMA_DECAYS = (None, 0.99, 0.995, 0.999)
FIELDS = ["epsilon", "activation", "batch_size", "epochs", "lr", "ema", "sigma", "steps", "public_val_accuracy",
          "seconds"]


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
                  hidden: tuple[int, ...] = (300, 100)) -> list[dict[str, Any]]:
    """One (activation, L, epochs) recipe at every rate in `lrs` and every EMA decay: one row each."""
    start = time.perf_counter()
    q = batch / private_size
    steps = -(-private_size // batch) * epochs
    sigma = calibrate_noise_multiplier(q, steps, eps, delta)
    arch = build_architecture(public.num_features, public.num_classes, hidden, None, activation)
    models = [LeNet(arch, torch.Generator().manual_seed(seed)) for _ in lrs]  # same θ0 for every rate
    stack = StackedMLP(models, [model.full_masks() for model in models])
    optimizer = PerCandidateSGD(stack.parameters(), torch.tensor(lrs), momentum)
    generator = torch.Generator().manual_seed(seed + 1)
    n = len(public.train)
    x_all, y_all = public.train.features, public.train.labels
    averages = {d: [p.detach().clone() for p in stack.parameters()] for d in EMA_DECAYS if d is not None}
    for _ in range(steps):
        index = poisson_sample(n, batch / n, generator, x_all.device)
        noisy_step(stack, optimizer, x_all.index_select(0, index), y_all.index_select(0, index), clip=clip,
                   noise_multiplier=sigma, expected_batch_size=batch, generator=generator)
        with torch.no_grad():
            for d, mean in averages.items():
                for m, p in zip(mean, stack.parameters()):
                    m.lerp_(p, 1.0 - d)
    rows = []
    final = [p.detach().clone() for p in stack.parameters()]
    for d in EMA_DECAYS:
        with torch.no_grad():
            for p, v in zip(stack.parameters(), final if d is None else averages[d]):
                p.copy_(v)
        scores = accuracies(stack, public.val.features, public.val.labels).tolist()
        for lr, score in zip(lrs, scores):
            rows.append({"epsilon": eps, "activation": activation, "batch_size": batch, "epochs": epochs,
                         "lr": lr, "ema": "" if d is None else d, "sigma": round(sigma, 5), "steps": steps,
                         "public_val_accuracy": round(score, 4),
                         "seconds": round(time.perf_counter() - start, 1)})
    return rows
