"""Poisson batches in static shapes, for CUDA graphs: pad to a fixed capacity, chunk the rare overflow.

A captured CUDA graph replays fixed tensor shapes, while a Poisson batch has Binomial(N, q) records.
So each batch is cut into chunks of exactly `capacity` rows: the sampled records, then padding
rows (record 0, any record would do) whose per-record weight is 0. The clipped sum weights every
record's clipped gradient by its weight, so a padding row adds exactly zero; a draw larger than
the capacity fills several chunks, whose clipped sums are added before the step's single noise
draw. Every sampled record is processed once and nothing else counts, so the mechanism — each
record in with probability q, the clipped sum over exactly the sampled records, one noise draw
per step — is the eager one (docs/privacy.md §7, "Padding for static shapes"). Dropping or capping
records would change it, and is never done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

TAIL_STANDARD_DEVIATIONS = 4.0
"""The capacity covers the batch size's mean plus this many standard deviations: P(overflow) per step
is about 3e-5 (a Binomial tail), and an overflowing step costs one more chunk, not a wrong result."""


def batch_capacity(dataset_size: int, sample_rate: float, multiple: int = 8) -> int:
    """K = ⌈qN + 4·√(qN(1 − q))⌉, rounded up to a multiple of 8 (aligned GEMMs), at most N."""
    mean = dataset_size * sample_rate
    spread = math.sqrt(mean * (1.0 - sample_rate))
    capacity = math.ceil(mean + TAIL_STANDARD_DEVIATIONS * spread)
    capacity = multiple * math.ceil(max(capacity, 1) / multiple)
    return min(capacity, max(dataset_size, 1))


@dataclass(frozen=True)
class PaddedChunk:
    """`capacity` rows: record indices, and weights 1 (sampled) or 0 (padding)."""

    index: Tensor
    weight: Tensor


def padded_chunks(index: Tensor, capacity: int, dtype: torch.dtype = torch.float32) -> list[PaddedChunk]:
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
