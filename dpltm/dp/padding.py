"""Poisson batches in static shapes, for CUDA graphs: pad to a fixed capacity, chunk the rare overflow.

A captured CUDA graph replays fixed tensor shapes, while a Poisson batch has Binomial(N, q) records.
So each batch is cut into chunks of exactly `capacity` rows: the sampled records, then padding
rows (any valid record: record 0, or one an earlier chunk left in the buffer) whose clipping bound
is 0: each row's clip factor is its bound over max(‖g‖, C) (C for a sampled record,
dpltm.dp.ghost.clip_factors), so a padding row adds exactly zero; a draw larger than
the capacity fills several chunks, whose clipped sums are added before the step's single noise
draw. Every sampled record is processed once and nothing else counts, so the mechanism — each
record in with probability q, the clipped sum over exactly the sampled records, one noise draw
per step — is the eager one (docs/privacy.md §7, "Padding for static shapes"). Dropping or capping
records would change it, and is never done.
"""

from __future__ import annotations

import math

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


def ones_then_zeros(capacity: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`capacity` ones then `capacity` zeros: every chunk's weights are one slice of it (`load_chunk`)."""
    weights = torch.zeros(2 * capacity, dtype=dtype, device=device)
    weights[:capacity] = 1
    return weights


def load_chunk(index: Tensor, start: int, into_index: Tensor, into_weight: Tensor, weights: Tensor) -> None:
    """The chunk of a Poisson batch that begins at row `start`, written into a step's fixed buffers with
    at most two copies and no allocation (what a CUDA-graph step pays per chunk on the host).

    The first m = min(K, |B| − start) rows get the sampled records' indices and a sampled row's weight (1, or the
    static DP step's C); the other rows get weight 0 and keep the indices they held (valid records of an earlier
    chunk, or record 0): such a row adds exactly zero (the tests' reference layout: tests/dp/reference.py
    `padded_chunks`). `weights` is `ones_then_zeros(K, ...)`, or a multiple of it (the static DP step's C times
    it: each row's clipping bound, dpltm.dp.graphed).
    """
    capacity = into_index.numel()
    m = max(0, min(capacity, index.numel() - start))
    if m:
        into_index[:m].copy_(index[start : start + m], non_blocking=True)
    into_weight.copy_(weights[capacity - m : 2 * capacity - m], non_blocking=True)
