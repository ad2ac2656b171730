"""nn.Linear's rule: ghost norms on flat inputs and on sequences, formed gradients where a mask forbids them.

On (B, in) inputs sample i's weight gradient is the outer product g_i a_iᵀ, so its masked squared norm
is Σ_jk g_ij² M_jk a_ik² = (g_i²)ᵀ M (a_i²): one matmul, no (B, out, in) tensor (Goodfellow 2015).

On sequences (B, T, in) the gradient is Σ_t g_it a_itᵀ = G_iᵀ A_i, and

    ‖G_iᵀ A_i‖²_F = tr(A_iᵀ G_i G_iᵀ A_i) = Σ_{t,t'} ⟨a_it, a_it'⟩ ⟨g_it, g_it'⟩ = ⟨A_i A_iᵀ, G_i G_iᵀ⟩_F,

two T × T Gram matrices per sample instead of the out × in gradient (ghost clipping, Li et al. 2022,
"Large language models can be strong differentially private learners", §4). It holds for the dense
weight only: with a mask M the norm is ‖(G_iᵀ A_i) ⊙ M‖², which does not factor through the Grams, so a
masked weight's per-sample gradients are formed, a chunk of samples at a time. Following Li et al., the Grams
are used where they take less memory than the gradients, 2T² < in·out (`use_grams`). Either way the clipped sum
is one product, (c ⊙ G)ᵀ A over all B·T rows — what a plain backward pass computes, with each row scaled by
its sample's clip factor — and nothing is held between the norm and the sum (the norm takes a sequence as the
operands of a one-group convolution over its positions, dpltm.dp.conv_ghost).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dpltm.dp.rules.base import LayerCall, LocalMasks, WeightAndBiasRule, masked_sq_norms, register_rule, zero_rows
from dpltm.dp.rules.conv import operand_sq_norms

SEQUENCE = "sequence"
"""The state of a sequence's norms: nothing held, its clipped sum is the product over every position."""


def sequence_operands(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(B, …, in) inputs and (B, …, out) output gradients as a one-group convolution's operands (dpltm.dp.conv_ghost):
    (B, 1, in, T) and (B, 1, out, T), the positions t the flattened middle dimensions."""
    rows = a.shape[0]
    return (a.reshape(rows, -1, a.shape[-1]).transpose(1, 2).unsqueeze(1),
            g.reshape(rows, -1, g.shape[-1]).transpose(1, 2).unsqueeze(1))


@register_rule(nn.Linear)
class LinearRule(WeightAndBiasRule):
    """nn.Linear: the masked ghost norm on (B, in) inputs; on (B, …, in) sequences the Gram ghost norm
    of a dense weight when cheaper, else the formed (masked) per-sample gradients."""

    @staticmethod
    def weight_grads(module: Any, a: Tensor, g: Tensor) -> Tensor:
        rows = g.shape[0]
        return torch.einsum("bto,bti->boi", g.reshape(rows, -1, g.shape[-1]), a.reshape(rows, -1, a.shape[-1]))

    @staticmethod
    def bias_grads(module: Any, g: Tensor) -> Tensor:
        return g.reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1)

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        """(B,) norms, and the per-sample gradients formed on the way (name → (B, *shape), maybe none)."""
        a = call.input
        assert a is not None
        module = call.module
        if a.dim() > 2:  # a sequence: the operands of a one-group convolution over its positions
            return operand_sq_norms(module, *sequence_operands(a, g), masks, g.dtype), SEQUENCE
        total = g.new_zeros(g.shape[0])
        formed: dict[str, Tensor] = {}
        if module.weight.requires_grad:
            total = total + self._flat_weight_norms(call, a, g * g, masks.get("weight"))
        if module.bias is not None and module.bias.requires_grad:
            formed["bias"] = g if "bias" not in masks else g * masks["bias"]
        for value in formed.values():
            total = total + value.reshape(value.shape[0], -1).pow(2).sum(dim=1)
        return total, formed

    @staticmethod
    def _flat_weight_norms(call: LayerCall, a: Tensor, g2: Tensor, mask: Tensor | None) -> Tensor:
        # ‖a_i‖² by a norm kernel: (a * a).sum(1) would write a (B, in) square first (15× slower on CPU
        # for the 4096 × 3969 scattering features of bench_masked_head.py)
        terms = call.input_terms
        if terms is not None and terms.shape[1] != (1 if mask is None else g2.shape[1]):
            terms = None  # not this layer's table: compute the norm
        if terms is not None:  # M a_i² (or ‖a_i‖²) looked up: the records' fixed share (engine tables)
            return g2.sum(dim=1) * terms[:, 0] if mask is None else (g2 * terms).sum(dim=1)
        if mask is None:
            return g2.sum(dim=1) * torch.linalg.vector_norm(a, dim=1).square()
        return masked_sq_norms(a, g2, mask.T)  # a transposed view: BLAS reads it as it is, no copy a step

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None,
                     masks: LocalMasks, state: Any) -> dict[str, Tensor]:
        a = call.input
        assert a is not None
        module = call.module
        sums = {}
        if module.weight.requires_grad:  # one product over every row, a sequence's positions too: no permuted copy
            rows_g = zero_rows(g, finite).to(factors.dtype)
            scaled = rows_g * factors.view(-1, *[1] * (g.dim() - 1))
            total = (scaled.reshape(-1, g.shape[-1]).T
                     @ zero_rows(a, finite).to(scaled.dtype).reshape(-1, a.shape[-1])).to(g.dtype)
            mask = masks.get("weight")
            sums["weight"] = total if mask is None else total.mul_(mask)
        if state is SEQUENCE:
            if module.bias is not None and module.bias.requires_grad:  # each sample's positions summed, then weighted
                per_sample = zero_rows(g, finite).reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1)
                total = (factors @ per_sample.to(factors.dtype)).to(g.dtype)
                sums["bias"] = total if "bias" not in masks else total.mul_(masks["bias"])
        elif "bias" in state:
            sums["bias"] = self._formed_sum(state["bias"], factors, finite)
        return sums

    @staticmethod
    def _formed_sum(formed: Tensor, factors: Tensor, finite: Tensor | None) -> Tensor:
        return torch.einsum("b,b...->...", factors, zero_rows(formed, finite).to(factors.dtype)).to(formed.dtype)
