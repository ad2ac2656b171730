"""nn.Embedding's rule: per-sample norms without a (B, vocabulary, d) tensor, the clipped sum by one scatter.

Sample i looks up rows id_i1 … id_iT; its weight gradient is zero except in those rows, where row v
holds Σ_{t: id_it = v} g_it. Its squared norm therefore only needs the tokens grouped by id:

* the Gram form, Σ_{t,t'} [id_it = id_it'] ⟨g_it, g_it'⟩ — a (T, T) Gram per sample (the ghost norm of
  Li et al. 2022, §4, for embeddings: the one-hot inputs' Gram is the equality of ids); B·T² memory;
* the segment form: add up each sample's g rows per distinct id (one sort and one scatter over the
  B·T tokens), then square; B·T·d memory, and the only form that can apply a mask: a pruned weight
  entry (v, k) removes coordinate k of row v's sum, which no Gram of the g's can see.

The Gram form is used for an unmasked weight when it is the smaller, T ≤ d. The clipped sum
Σ_i c_i ∇ℓ_i ⊙ M scatters the rows c_i g_it into their ids, as a plain backward pass does.

The padding row gets no gradient (the module's contract: its tokens' g rows are dropped). With
`scale_grad_by_freq` autograd divides each token's g by its id's count in the whole batch, a gradient
that depends on the other samples; the per-sample gradient (of the sample's loss alone, as torch.func
forms it) divides by the count within the sample, and that is what is clipped and summed here. Sparse
gradients are refused by `check` (the clipped sum is a dense tensor the optimiser would not expect);
`max_norm` is refused by the engine (its forward writes to the weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dpltm.dp.rules.base import LayerCall, LocalMasks, register_rule, zero_rows
from dpltm.errors import DpltmUserError


def use_gram(tokens: int, width: int) -> bool:
    """Whether the (T, T) Gram per sample is no larger than the per-id sums it replaces (T × d at most)."""
    return tokens <= width


@register_rule(nn.Embedding)
class EmbeddingRule:
    """nn.Embedding: Gram or segment-sum norms, one `index_add_` for the clipped sum."""

    def check(self, label: str, module: nn.Module) -> None:
        if bool(getattr(module, "sparse", False)):
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has sparse gradients: not supported by "
                                 "dpltm's per-sample clipping (use sparse=False)")

    @staticmethod
    def _tokens(call: LayerCall, g: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T) ids and (B, T, d) per-token output gradients, the padding tokens' rows zero and, with
        `scale_grad_by_freq`, each row divided by its id's count in its sample."""
        module, ids = call.module, call.input
        assert ids is not None
        rows = ids.shape[0]
        ids, g = ids.reshape(rows, -1), g.reshape(rows, -1, g.shape[-1])
        if module.padding_idx is not None:  # where, not a product: an inf in a dropped row must vanish
            g = torch.where((ids != module.padding_idx).unsqueeze(2), g, torch.zeros((), dtype=g.dtype,
                                                                                    device=g.device))
        if module.scale_grad_by_freq:
            _, inverse, counts = torch.unique(_sample_keys(ids, module.num_embeddings), return_inverse=True,
                                              return_counts=True)
            g = g / counts[inverse].unsqueeze(2).to(g.dtype)
        return ids, g

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        """(B,) norms, and the prepared (ids, g) for `clipped_sums` (None where the call may not hold them)."""
        ids, tokens = self._tokens(call, g)
        mask = masks.get("weight")
        if mask is None and use_gram(ids.shape[1], tokens.shape[2]):
            same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(tokens.dtype)
            return torch.bmm(tokens, tokens.transpose(1, 2)).mul_(same).sum(dim=(1, 2)), self._kept(call, ids, tokens)
        vocabulary = call.module.num_embeddings
        keys, inverse = torch.unique(_sample_keys(ids, vocabulary), return_inverse=True)
        per_id = tokens.new_zeros(keys.shape[0], tokens.shape[2]).index_add_(0, inverse.flatten(),
                                                                               tokens.reshape(-1, tokens.shape[2]))
        if mask is not None:
            per_id = per_id * mask.index_select(0, keys % vocabulary)
        norms = tokens.new_zeros(ids.shape[0]).index_add_(0, keys // vocabulary, per_id.pow(2).sum(dim=1))
        return norms, self._kept(call, ids, tokens)

    @staticmethod
    def _kept(call: LayerCall, ids: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor] | None:
        return (ids, tokens) if call.hold_for_sum else None

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None, masks: LocalMasks,
                     state: Any) -> dict[str, Tensor]:
        ids, tokens = state if state is not None else self._tokens(call, g)
        weight = call.module.weight
        scaled = zero_rows(tokens, finite).to(factors.dtype) * factors.view(-1, 1, 1)
        total = scaled.new_zeros(weight.shape).index_add_(0, ids.flatten(), scaled.reshape(-1, weight.shape[1]))
        mask = masks.get("weight")
        total = total.to(g.dtype)
        return {"weight": total if mask is None else total.mul_(mask)}


def _sample_keys(ids: Tensor, vocabulary: int) -> Tensor:
    """One key per (sample, id) pair: b·V + id, so that equal ids in different samples stay apart."""
    return ids + torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) * vocabulary
