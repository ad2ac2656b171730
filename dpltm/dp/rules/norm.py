"""GroupNorm's, LayerNorm's and RMSNorm's rule: per-sample affine gradients from the recomputed x̂.

Each computes z = x̂ ⊙ γ + β (RMSNorm: no β), broadcasting γ and β (one value per channel for GroupNorm,
one per entry of `normalized_shape` for LayerNorm and RMSNorm) over the other non-batch dimensions,
where x̂ normalises each sample by statistics of that sample alone. So sample i's gradients are sums
over the broadcast dimensions: ∇γ ℓ_i = Σ g_i ⊙ x̂_i and ∇β ℓ_i = Σ g_i — as small as the parameters,
formed outright. x̂ is not recorded; it is recomputed from the recorded input with the layer's own
groups, shape and eps (the forward pass's arithmetic, so it matches to rounding). A layer without
affine parameters owns nothing to clip and never reaches its rule.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.rules.base import WeightAndBiasRule, register_rule


@register_rule(nn.GroupNorm)
class GroupNormRule(WeightAndBiasRule):
    """nn.GroupNorm on (B, C, *): gradients per channel, summed over the positions."""

    @staticmethod
    def weight_grads(module: Any, a: Tensor, g: Tensor) -> Tensor:
        normalised = F.group_norm(a, module.num_groups, None, None, module.eps)
        return (g * normalised).flatten(2).sum(dim=2) if g.dim() > 2 else g * normalised

    @staticmethod
    def bias_grads(module: Any, g: Tensor) -> Tensor:
        return g.flatten(2).sum(dim=2) if g.dim() > 2 else g


@register_rule(nn.LayerNorm)
class LayerNormRule(WeightAndBiasRule):
    """nn.LayerNorm on (B, …, *normalized_shape): gradients per normalised entry, summed over the
    dimensions in between (a sequence's positions)."""

    @staticmethod
    def _sum_between(module: Any, values: Tensor) -> Tensor:
        between = tuple(range(1, values.dim() - len(module.normalized_shape)))
        return values.sum(dim=between) if between else values

    @staticmethod
    def weight_grads(module: Any, a: Tensor, g: Tensor) -> Tensor:
        normalised = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        return LayerNormRule._sum_between(module, g * normalised)

    @staticmethod
    def bias_grads(module: Any, g: Tensor) -> Tensor:
        return LayerNormRule._sum_between(module, g)


if hasattr(nn, "RMSNorm"):
    @register_rule(nn.RMSNorm)
    class RMSNormRule(LayerNormRule):
        """nn.RMSNorm: z = x / rms(x) ⊙ γ, the gradient of γ as LayerNorm's (it has no bias)."""

        @staticmethod
        def weight_grads(module: Any, a: Tensor, g: Tensor) -> Tensor:
            normalised = F.rms_norm(a, module.normalized_shape, None, module.eps)
            return LayerNormRule._sum_between(module, g * normalised)
