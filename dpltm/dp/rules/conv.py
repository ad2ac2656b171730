"""nn.Conv1d and nn.Conv2d's rule: per-sample weight gradients from unfolded input patches.

A convolution is a matmul per output position: z_i[:, l] = W u_il with u_il the input patch that
position reads, so sample i's weight gradient is Σ_l g_il u_ilᵀ = G_i U_iᵀ (per group). No ghost identity
survives the sum over positions once the weight is masked, so the gradient is formed, one einsum per
layer (the per-sample gradient of Goodfellow 2015 / Opacus's unfold rule). A 1-D convolution is the 2-D
one on an input of height 1 with a 1 × k kernel, which lets one `F.unfold` serve both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.rules.base import WeightAndBiasRule, register_rule


def conv_weight_grads(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients (B, out, in/groups, *kernel) of a 1-D or 2-D convolution with input
    `a` and output gradient `g`: per group, G_i U_iᵀ with U_i sample i's unfolded input patches. Padding
    other than numeric zeros ('same', reflect, replicate, circular) is applied first, exactly as the
    module does."""
    padding: Any = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * len(module.kernel_size)
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    if len(kernel) == 1:  # (B, C, L) as (B, C, 1, L), a 1 × k kernel
        a, g = a.unsqueeze(2), g.unsqueeze(2)
        kernel, dilation, stride, padding = (1, *kernel), (1, *dilation), (1, *stride), (0, *padding)
    patches = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)  # type: ignore[arg-type]
    groups, rows = module.groups, a.shape[0]
    out_per_group = module.out_channels // groups
    grads = torch.einsum("bgol,bgcl->bgoc", g.reshape(rows, groups, out_per_group, -1),
                         patches.reshape(rows, groups, patches.shape[1] // groups, -1))
    return grads.reshape(rows, *module.weight.shape)


def conv2d_weight_grads(module: nn.Conv2d, a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients (B, out, in/groups, kh, kw) of a 2-D convolution (`conv_weight_grads`)."""
    return conv_weight_grads(module, a, g)


class ConvRule(WeightAndBiasRule):
    """A convolution (any stride, dilation, groups, numeric or 'same'/'valid' padding, any padding mode):
    unfolded patches, one einsum per layer."""

    weight_grads = staticmethod(conv_weight_grads)

    @staticmethod
    def bias_grads(module: Any, g: Tensor) -> Tensor:
        return g.flatten(2).sum(dim=2)


@register_rule(nn.Conv1d)
class Conv1dRule(ConvRule):
    """nn.Conv1d: the 2-D patches of an input of height 1."""


@register_rule(nn.Conv2d)
class Conv2dRule(ConvRule):
    """nn.Conv2d."""
