"""Exact per-layer rules for GroupNorm, LayerNorm and Embedding: the layers of today's CNNs and transformers.

* GroupNorm and LayerNorm: y = x̂ ⊙ γ + β with x̂ the input normalised per sample (and group): sample i's gradients
  are ∇γ = Σ g_i ⊙ x̂_i and ∇β = Σ g_i over the positions γ is shared across (spatial positions, a sequence's
  tokens). x̂ is recomputed from the recorded input with the layer's own ε: no statistic crosses samples.
* Embedding: sample i's gradient puts Σ_{t: id_t = v} g_it on row v. Its rows are summed per (sample, id) by one
  scatter-add over the batch's distinct pairs, so its (masked) squared norm costs B·T·d, not a (B, vocabulary, d)
  tensor; the clipped sum is one scatter-add of the rows c_i·g_it. A `padding_idx` row takes no gradient, as in the
  layer. `max_norm` (the layer rewrites its weights in the forward pass), `scale_grad_by_freq` (a token's gradient
  divided by its count in the whole batch: one record's gradient would depend on the others) and `sparse` are
  refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.rules import LayerCall, LocalMasks, MaterialisedRule, _zero_rows, register_rule
from dpltm.errors import DpltmUserError


def _affine_grads(call: LayerCall, g: Tensor, normalised: Tensor, shared: tuple[int, ...]) -> dict[str, Tensor]:
    """Per-sample ∇γ and ∇β of an affine normalisation: g ⊙ x̂ and g summed over the `shared` dimensions."""
    module, grads = call.module, {}
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is not None and weight.requires_grad:
        grads["weight"] = (g * normalised).sum(dim=shared) if shared else g * normalised
    if bias is not None and bias.requires_grad:
        grads["bias"] = g.sum(dim=shared) if shared else g
    return grads


@register_rule(nn.GroupNorm)
class GroupNormRule(MaterialisedRule):
    """nn.GroupNorm: ∇γ_c = Σ_s g_cs x̂_cs and ∇β_c = Σ_s g_cs per sample (B × C numbers each)."""

    def per_sample_grads(self, call: LayerCall, g: Tensor) -> dict[str, Tensor]:
        module, a = call.module, call.input
        assert a is not None and isinstance(module, nn.GroupNorm)
        normalised = F.group_norm(a, module.num_groups, None, None, module.eps)
        return _affine_grads(call, g, normalised, tuple(range(2, g.dim())))


@register_rule(nn.LayerNorm)
class LayerNormRule(MaterialisedRule):
    """nn.LayerNorm: ∇γ = Σ_t g_t ⊙ x̂_t and ∇β = Σ_t g_t per sample, over the dimensions before the normalised
    shape (a sequence's tokens)."""

    def per_sample_grads(self, call: LayerCall, g: Tensor) -> dict[str, Tensor]:
        module, a = call.module, call.input
        assert a is not None and isinstance(module, nn.LayerNorm)
        normalised = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        return _affine_grads(call, g, normalised, tuple(range(1, g.dim() - len(module.normalized_shape))))


@register_rule(nn.Embedding)
class EmbeddingRule:
    """nn.Embedding: per-(sample, id) sums of the output gradient's rows by one scatter-add."""

    def check(self, label: str, module: nn.Module) -> None:
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None:
            raise DpltmUserError(f"layer {label} (Embedding) has max_norm: it rewrites its weights in the forward "
                                 "pass, outside the DP step; renormalise after the step instead, or drop max_norm")
        if module.sparse:
            raise DpltmUserError(f"layer {label} (Embedding) has sparse gradients: not supported by dpltm's per-sample "
                                 "clipping (use sparse=False)")
        if module.scale_grad_by_freq:
            raise DpltmUserError(f"layer {label} (Embedding) has scale_grad_by_freq: each token's gradient is divided "
                                 "by its count in the whole batch, so one record's gradient depends on the others")

    @staticmethod
    def _rows(call: LayerCall, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(pair, ids, rows): for every distinct (sample, id) of the batch its sample, id and summed gradient row."""
        ids = call.input
        assert ids is not None
        batch, dim = g.shape[0], g.shape[-1]
        ids, g = ids.reshape(batch, -1), g.reshape(batch, -1, dim)
        padding = call.module.padding_idx  # type: ignore[union-attr]
        if padding is not None:
            g = g * (ids != padding).unsqueeze(-1).to(g.dtype)
        num = call.module.num_embeddings  # type: ignore[union-attr]
        keys = (torch.arange(batch, device=ids.device).unsqueeze(1) * num + ids).reshape(-1)
        pairs, slot = torch.unique(keys, return_inverse=True)
        rows = g.new_zeros(pairs.shape[0], dim).index_add_(0, slot, g.reshape(-1, dim))
        return pairs // num, pairs % num, rows

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        if not call.module.weight.requires_grad:  # type: ignore[union-attr]
            return g.new_zeros(g.shape[0]), None
        sample, ids, rows = self._rows(call, g)
        mask = masks.get("weight")
        if mask is not None:
            rows = rows * mask.index_select(0, ids)
        norms = g.new_zeros(g.shape[0]).index_add_(0, sample, rows.pow(2).sum(dim=1))
        return norms, None

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None, masks: LocalMasks,
                     state: Any) -> dict[str, Tensor]:
        if not call.module.weight.requires_grad:  # type: ignore[union-attr]
            return {}
        ids = call.input
        assert ids is not None
        batch, dim = g.shape[0], g.shape[-1]
        scaled = _zero_rows(g, finite).to(factors.dtype).reshape(batch, -1, dim) * factors.view(-1, 1, 1)
        flat_ids = ids.reshape(batch, -1)
        padding = call.module.padding_idx  # type: ignore[union-attr]
        if padding is not None:
            scaled = scaled * (flat_ids != padding).unsqueeze(-1).to(scaled.dtype)
        weight = call.module.weight  # type: ignore[union-attr]
        total = scaled.new_zeros(weight.shape).index_add_(0, flat_ids.reshape(-1), scaled.reshape(-1, dim))
        mask = masks.get("weight")
        return {"weight": (total if mask is None else total * mask).to(g.dtype)}
