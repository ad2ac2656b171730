"""nn.Conv1d and nn.Conv2d's rule: exact masked per-sample norms and clipped sums without torch.func.

A convolution is a matmul per output position: z_i[:, l] = W u_il with u_il the input patch that position
reads, so sample i's weight gradient is Σ_l g_il u_ilᵀ = G_i U_iᵀ (per group). Its norm is taken by the cheaper
of two T × T Grams (the ghost norm, Li et al. 2022 §4; Bu et al. 2022's mixed ghost clipping) and the formed
gradient, formed a chunk of samples at a time (under a mask, which no Gram identity survives) from unfolded
patches or, on the CPU at many positions, as one grouped weight gradient; the clipped sum is B numbers a
coordinate from gradients so formed, else the layer's weight-gradient kernel on the scaled output gradient
(dpltm.dp.conv_ghost). A 1-D convolution is the 2-D one on an input of height 1 with a 1 × k kernel, which lets
one `F.unfold` serve both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dpltm.dp.conv_ghost import (
    clipped_bias_sum,
    clipped_weight_sum,
    conv_operands,
    formed_sum,
    forms_by_groups,
    grouped_grads,
    takes_the_kernel,
    weight_sq_norms,
)
from dpltm.dp.rules.base import LayerCall, LocalMasks, WeightAndBiasRule, register_rule, zero_rows


def conv_weight_grads(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients (B, out, in/groups, *kernel) of a 1-D or 2-D convolution with input `a` and
    output gradient `g`: per group, G_i U_iᵀ with U_i sample i's unfolded input patches (`conv_operands`)."""
    patches, grads = conv_operands(module, a, g)
    return torch.einsum("bgot,bgkt->bgok", grads, patches).reshape(a.shape[0], *module.weight.shape)


KEEP_FORMED_MAX_BYTES = 1 << 25
"""A convolution's formed per-sample gradients (the CPU) or unfolded patches (other devices) up to this size
(32 MB) are kept from its norms to its sum; larger ones are formed or unfolded again for the sum rather than held."""


class FormAgain:
    """The state of a layer whose formed gradients were not kept: the sum forms them again, chunk by chunk."""


def conv_clipped_sums(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor, factors: Tensor, finite: Tensor | None,
                      masks: LocalMasks, formed: list[Tensor] | FormAgain | Tensor | None) -> dict[str, Tensor]:
    """The clipped sums of a convolution with input `a` and output gradient `g` (dpltm.dp.conv_ghost), then the
    mask: from the formed gradients where the norms formed them (a list, or `FormAgain`), else
    `clipped_weight_sum` (with the patches the norms unfolded, where kept: a tensor)."""
    sums = {}
    if module.weight.requires_grad:
        if formed is None or isinstance(formed, Tensor):
            patches = None if formed is None else zero_rows(formed, finite)
            total = clipped_weight_sum(module, zero_rows(a, finite), zero_rows(g, finite), factors, patches)
        else:
            chunks = grouped_grads(module, a, g, masks.get("weight")) if isinstance(formed, FormAgain) else formed
            total = formed_sum(chunks, factors, finite).reshape(module.weight.shape)
        total = total.to(g.dtype)
        sums["weight"] = total if "weight" not in masks else total.mul_(masks["weight"])
    if module.bias is not None and module.bias.requires_grad:
        grads = zero_rows(g, finite).reshape(g.shape[0], module.groups, module.out_channels // module.groups, -1)
        total = clipped_bias_sum(grads, factors).to(g.dtype)
        sums["bias"] = total if "bias" not in masks else total.mul_(masks["bias"])
    return sums


def operand_sq_norms(module: nn.Module, patches: Tensor, grads: Tensor, masks: LocalMasks,
                     dtype: torch.dtype) -> Tensor:
    """(B,) squared norms over the surviving coordinates from a convolution's or sequence Linear's operands."""
    total = grads.new_zeros(grads.shape[0], dtype=torch.promote_types(dtype, torch.float32))
    if module.weight.requires_grad:
        mask = masks.get("weight")
        total = total + weight_sq_norms(patches, grads, None if mask is None else mask.reshape(grads.shape[1],
                                                                                                grads.shape[2], -1))
    if module.bias is not None and module.bias.requires_grad:
        total = total + bias_sq_norms(grads.sum(dim=3).reshape(grads.shape[0], -1), masks)
    return total


def bias_sq_norms(per_sample: Tensor, masks: LocalMasks) -> Tensor:
    """(B,) squared norms of the per-sample bias gradients (B, out) over the surviving coordinates."""
    return (per_sample if "bias" not in masks else per_sample * masks["bias"]).pow(2).sum(dim=1)


def conv2d_weight_grads(module: nn.Conv2d, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients (B, out, in/groups, kh, kw) of a 2-D convolution (`conv_weight_grads`)."""
    return conv_weight_grads(module, a, g)


class ConvRule(WeightAndBiasRule):
    """A convolution (any stride, dilation, groups, numeric or 'same'/'valid' padding, any padding mode): the norm
    by the cheaper of the ghost norm and formed gradients (formed, a chunk of samples at a time, under a mask); the
    clipped sum from the formed gradients where the norms formed them by groups, else by the layer's weight-gradient
    kernel."""

    weight_grads = staticmethod(conv_weight_grads)

    @staticmethod
    def bias_grads(module: Any, g: Tensor) -> Tensor:
        return g.flatten(2).sum(dim=2)

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        """The norms, and the formed gradients where the norms formed them by groups (kept for the sum when small,
        else `FormAgain`); off the CPU the unfolded patches where small; else None."""
        assert call.input is not None
        module = call.module
        if not (module.weight.requires_grad and call.input.dtype == g.dtype  # not under autocast
                and forms_by_groups(module, g, "weight" in masks)):  # type: ignore[arg-type]
            patches, grads = conv_operands(module, call.input, g)  # type: ignore[arg-type]
            keep = (not takes_the_kernel(g) and call.hold_for_sum
                    and patches.numel() * patches.element_size() <= KEEP_FORMED_MAX_BYTES)
            return operand_sq_norms(module, patches, grads, masks, g.dtype), patches if keep else None
        keep = call.hold_for_sum and g.shape[0] * module.weight.numel() * g.element_size() <= KEEP_FORMED_MAX_BYTES
        chunks = grouped_grads(module, call.input, g, masks.get("weight"))  # type: ignore[arg-type]
        state: list[Tensor] | FormAgain = list(chunks) if keep else FormAgain()
        total = torch.cat([torch.linalg.vector_norm(formed, dim=(1, 2)).square()
                           for formed in (state if keep else chunks)])  # type: ignore[union-attr]
        total = total.to(torch.promote_types(g.dtype, torch.float32))
        if module.bias is not None and module.bias.requires_grad:
            total = total + bias_sq_norms(g.flatten(2).sum(dim=2), masks)
        return total, state

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None,
                     masks: LocalMasks, state: Any) -> dict[str, Tensor]:
        assert call.input is not None
        return conv_clipped_sums(call.module, call.input, g, factors, finite, masks, state)  # type: ignore[arg-type]


@register_rule(nn.Conv1d)
class Conv1dRule(ConvRule):
    """nn.Conv1d: the 2-D patches of an input of height 1."""


@register_rule(nn.Conv2d)
class Conv2dRule(ConvRule):
    """nn.Conv2d."""
