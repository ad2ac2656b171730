"""The exponential moving average of DP iterates: what a run may release instead of the last iterate.

EMA_1 = θ_1, EMA_t = d_t·EMA_{t-1} + (1 − d_t)·θ_t with d_t = decay, or with a warm-up (TensorFlow's
`ExponentialMovingAverage(num_updates=…)` rule) d_t = min(decay, (1 + t)/(10 + t)): early iterates are
forgotten as fast as an average of the last ~t/9 steps, so a run that starts far from where it ends (a
public-trained start, a random θ0) is not dragged back to its first iterate — without it, θ_1 still
weighs decay^(T−1) at the end (0.18 for decay 0.999 over T = 1700 steps). It is computed from the
released iterates alone, so it is post-processing (docs/privacy.md §7) and costs no privacy. The update
is written without a host synchronisation (torch's `AveragedModel.update_parameters` reads its step
counter on the host twice per step), so it can sit inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

WARMUP_OFFSET = 10.0
"""TensorFlow's constant in d_t = min(decay, (1 + t)/(10 + t))."""


@dataclass(frozen=True)
class Ema:
    """How the iterates are averaged: the decay and whether it warms up."""

    decay: float
    warmup: bool = False

    @classmethod
    def of(cls, decay: float | None, warmup: bool = False) -> Ema | None:
        """The average a run's settings ask for (None: the final iterate is released)."""
        return None if decay is None else cls(decay, warmup)

    def weight(self, count: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        """The new iterate's weight 1 − d_t after `count` earlier updates: 1 at the first (EMA_1 = θ_1).

        A tensor in, a tensor out, on the counter's device: no host synchronisation. `dtype`: the weights'
        own (an MPS device has no float64)."""
        t = count.to(dtype)
        decay = torch.clamp((1.0 + t) / (WARMUP_OFFSET + t), max=self.decay) if self.warmup else self.decay
        return 1.0 - (t > 0).to(dtype) * decay

    def describe(self) -> str:
        """How the report names the released weights."""
        return f"ema({self.decay:g}{', warm-up' if self.warmup else ''})"


def make_averager(model: nn.Module, ema: Ema | None) -> AveragedModel | None:
    """An EMA of `model`'s parameters (None when `ema` is None), to be updated after each step.

    `AveragedModel` copies the model and holds the average of its *parameters*: a ticket's pruned
    coordinates, exactly 0 in every iterate, stay exactly 0 in the average (the ticket's masks, beside
    the model, hold for it as they are).
    """
    if ema is None:
        return None
    # the step counter lives beside the weights: its update is device work (no host round trip);
    # update_average, not torch's update_parameters (which reads the counter on the host), updates it
    return AveragedModel(model, device=next(model.parameters()).device, use_buffers=False,
                         multi_avg_fn=get_ema_multi_avg_fn(ema.decay))


@torch.no_grad()
def average_into(averaged: Iterable[Tensor], current: Iterable[Tensor], count: Tensor, ema: Ema) -> None:
    """One EMA step of the tensors `averaged` towards `current`, then `count` += 1; on the device."""
    current = list(current)
    weight = ema.weight(count, current[0].dtype if current else torch.float64)
    for mean, theta in zip(averaged, current, strict=True):
        mean.lerp_(theta, weight.to(device=theta.device, dtype=theta.dtype))
    count.add_(1)


def update_average(averager: AveragedModel, model: nn.Module, ema: Ema) -> None:
    """One EMA step of `averager` towards `model`'s current parameters."""
    average_into([p.detach() for p in averager.module.parameters()], [p.detach() for p in model.parameters()],
                 averager.n_averaged, ema)


def released_model(model: nn.Module, averager: AveragedModel | None) -> nn.Module:
    """What a run evaluates and releases: the EMA when there is one, else the current iterate."""
    if averager is None:
        return model
    averaged = averager.module
    assert isinstance(averaged, nn.Module)
    return averaged


def released_weights(ema: Ema | None) -> str:
    """How the report names the released weights."""
    return "final iterate" if ema is None else ema.describe()
