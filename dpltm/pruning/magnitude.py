"""Layer-wise magnitude pruning (Frankle & Carbin 2019; DPLTM paper Alg. 1 line 9, §4.2).

Each round removes a fixed fraction of the weights that *survive* in each layer: the ones
of smallest magnitude. The number removed is ceil(rate × survivors), as in open_lth, so a
layer always shrinks while it has weights left; ties are broken by position, so the result
is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dpltm.errors import DpltmUserError

Masks = dict[str, Tensor]


def paper_prune_rates(layer_names: Sequence[str], hidden_rate: float = 0.3,
                      output_rate: float = 0.2) -> dict[str, float]:
    """The paper's rates (§4.2): 30 % per round for every layer but the output, 20 % there."""
    names = list(layer_names)
    return {n: (output_rate if i == len(names) - 1 else hidden_rate) for i, n in enumerate(names)}


def check_rates(rates: Mapping[str, float]) -> None:
    for name, rate in rates.items():
        if not 0.0 < float(rate) < 1.0:
            raise DpltmUserError(f"prune rate for {name} must lie in (0, 1), got {rate}")


def pruned_count(survivors: int, rate: float) -> int:
    """How many of a layer's `survivors` one round at `rate` removes: ⌈rate·survivors⌉ (open_lth's rule)."""
    return min(survivors, math.ceil(float(rate) * survivors))


def prune_layerwise(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor],
                    rates: Mapping[str, float]) -> Masks:
    """A new mask per layer, inside the old one, without the smallest surviving weights.

    `weights` are the trained weights, `masks` the current bool masks, `rates` the fraction of
    each layer's survivors to remove. Layers missing from `rates` are left as they are.
    """
    check_rates(rates)
    unknown = sorted(set(rates) - set(masks))
    if unknown:
        raise DpltmUserError(f"prune rates name unknown layers: {unknown}")
    new: Masks = {}
    for name, mask in masks.items():
        mask = mask.to(device=weights[name].device, dtype=torch.bool)
        rate = rates.get(name)
        survivors = int(mask.sum())
        if rate is None or survivors == 0:
            new[name] = mask.clone()
            continue
        n_prune = pruned_count(survivors, rate)
        magnitude = weights[name].detach().abs().flatten().to(torch.float64)
        # Pruned weights must never be picked again: give them +inf magnitude.
        magnitude = torch.where(mask.flatten(), magnitude, torch.full_like(magnitude, math.inf))
        # Stable sort: equal magnitudes are removed in index order (deterministic).
        order = torch.sort(magnitude, stable=True).indices
        flat = mask.flatten().clone()
        flat[order[:n_prune]] = False
        new[name] = flat.view_as(mask)
    return new


def prune_input_features(weight: Tensor, mask: Tensor, keep: float) -> Tensor:
    """A first layer's new mask, inside the old one, keeping the `keep` fraction of its surviving input
    features (columns of a (out, in) weight) whose weights have the largest L2 norm; every other column pruned whole.

    DP feature selection: over DP-trained `weight` (a private ticket's warm-up) this is post-processing of a DP
    release (Dwork & Roth 2014, Prop. 2.1), so it costs no ε beyond the warm-up's. Pruning whole inputs also
    shrinks every record's gradient (the pruned features drop out of its norm), so fewer records are clipped.
    At least one feature is kept; ties are broken by position (a stable sort), so the result is deterministic."""
    if weight.dim() != 2:
        raise DpltmUserError(f"input features are pruned in a linear first layer, whose weight is (out, in); this "
                             f"network's first weight has shape {tuple(weight.shape)} (a convolution: prune weights)")
    if not 0.0 < keep <= 1.0:
        raise DpltmUserError(f"the fraction of input features kept must lie in (0, 1], got {keep:g}")
    mask = mask.to(device=weight.device, dtype=torch.bool)
    alive = mask.any(dim=0)
    n_keep = max(1, math.ceil(keep * int(alive.sum()) - 1e-9))
    norms = (weight.detach().to(torch.float64) * mask).norm(dim=0)
    norms = torch.where(alive, norms, torch.full_like(norms, -math.inf))  # pruned columns never come back
    order = torch.sort(-norms, stable=True).indices
    kept = torch.zeros_like(alive)
    kept[order[:n_keep]] = True
    return mask & kept[None, :]


def random_masks_like(masks: Mapping[str, Tensor], generator: torch.Generator) -> Masks:
    """Control ticket: a random mask with each layer's density kept exactly (Frankle & Carbin §2)."""
    out: Masks = {}
    for name, mask in masks.items():
        kept = int(mask.sum())
        order = torch.randperm(mask.numel(), generator=generator, device="cpu")
        flat = torch.zeros(mask.numel(), dtype=torch.bool)
        flat[order[:kept]] = True
        out[name] = flat.view(mask.shape).to(mask.device)
    return out
