"""The exponential moving average of DP iterates: what a run may release instead of the last iterate.

EMA_1 = θ_1, EMA_t = decay·EMA_{t-1} + (1 − decay)·θ_t. It is computed from the released iterates
alone, so it is post-processing (docs/privacy.md §7) and costs no privacy. The update is written
without a host synchronisation (torch's `AveragedModel.update_parameters` reads its step counter
on the host twice per step), so it can sit inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def make_averager(model: nn.Module, decay: float | None) -> AveragedModel | None:
    """An EMA of `model`'s parameters (None when `decay` is None), to be updated after each step.

    `AveragedModel` copies the model and holds the average of its *parameters*: a ticket's pruned
    coordinates, exactly 0 in every iterate, stay exactly 0 in the average (the ticket's masks, beside
    the model, hold for it as they are).
    """
    if decay is None:
        return None
    # the step counter lives beside the weights: its update is device work (no host round trip);
    # torch's own update_parameters (an EMA too, with this multi_avg_fn) agrees with update_average
    return AveragedModel(model, device=next(model.parameters()).device, use_buffers=False,
                         multi_avg_fn=get_ema_multi_avg_fn(decay))


@torch.no_grad()
def update_average(averager: AveragedModel, model: nn.Module, decay: float) -> None:
    """One EMA step, on the device: weight 1 at the first update (EMA_1 = θ_1), 1 − decay after."""
    count = averager.n_averaged
    first = next(model.parameters())
    one = torch.ones((), dtype=first.dtype, device=first.device)
    weight = torch.where(count.to(first.device) == 0, one, one * (1.0 - decay))
    averaged = [p.detach() for p in averager.module.parameters()]
    current = [p.detach() for p in model.parameters()]
    for ema, theta in zip(averaged, current, strict=True):
        ema.lerp_(theta, weight)
    count.add_(1)


def released_model(model: nn.Module, averager: AveragedModel | None) -> nn.Module:
    """What a run evaluates and releases: the EMA when there is one, else the current iterate."""
    if averager is None:
        return model
    averaged = averager.module
    assert isinstance(averaged, nn.Module)
    return averaged


def released_weights(decay: float | None) -> str:
    """How the report names the released weights."""
    return "final iterate" if decay is None else f"ema({decay:g})"
