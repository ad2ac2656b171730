"""The reference the DP steps are checked against: per-sample gradients from torch.func (vmap of grad),
restricted to a ticket's surviving weights, their norms, and the clipped sum (Abadi et al. 2016, Alg. 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


@dataclass(frozen=True)
class MaskedReference:
    per_sample: dict[str, torch.Tensor]
    """Each record's gradient over the surviving weights of the trainable parameters (pruned weights and
    frozen parameters are not trained)."""
    norms: torch.Tensor
    clip: float
    """The clip norm asked for, or the median norm: half the records are clipped."""
    factors: torch.Tensor
    clipped_sum: dict[str, torch.Tensor]


def masked_reference(model: nn.Module, masks: dict[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor, clip: float | None = None) -> MaskedReference:
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}  # constants

    def loss(p, xi, yi):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(model, {**frozen, **p}, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    per_sample = {k: g * masks[k].to(g.dtype) if k in masks else g for k, g in per_sample.items()}
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in per_sample.values()))
    clip = float(norms.median()) if clip is None else clip
    factors = (clip / norms).clamp(max=1.0)
    clipped = {k: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in per_sample.items()}
    return MaskedReference(per_sample, norms, clip, factors, clipped)


# ---- the padded-chunk layout the static-shape step must reproduce (dpltm.dp.padding.load_chunk) -----


@dataclass(frozen=True)
class PaddedChunk:
    """`capacity` rows: record indices, and weights 1 (sampled) or 0 (padding)."""

    index: torch.Tensor
    weight: torch.Tensor


def padded_chunks(index: torch.Tensor, capacity: int, dtype: torch.dtype = torch.float32) -> list[PaddedChunk]:
    """A Poisson batch's record indices as ⌈|B|/K⌉ chunks of exactly K rows (one chunk if B is empty)."""
    if capacity < 1:
        raise ValueError(f"capacity must be ≥ 1, got {capacity}")
    chunks = []
    for start in range(0, max(index.numel(), 1), capacity):
        part = index[start : start + capacity]
        padding = capacity - part.numel()
        chunks.append(PaddedChunk(
            torch.cat([part, part.new_zeros(padding)]),
            torch.cat([torch.ones(part.numel(), dtype=dtype, device=index.device),
                       torch.zeros(padding, dtype=dtype, device=index.device)]),
        ))
    return chunks
