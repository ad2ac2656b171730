"""Poisson sampling: each record joins a batch independently with probability q.

This is the sampling the Poisson-subsampled Gaussian accountant assumes (Abadi et al. 2016;
Mironov et al. 2019; Zhu & Wang 2019). Batch sizes are Binomial(N, q); an empty batch is a
legal step (it still adds noise and is still counted). Shuffled fixed-size batches are a
different mechanism (Chua et al. 2024) and are not offered here.

The accountant is told q, so each record's realised inclusion probability must never exceed
q (docs/privacy.md §7): a larger rate is a weaker guarantee than the one reported. Comparing
float32 uniforms with q does not ensure it: on CPU `torch.rand` gives multiples of 2⁻²⁴, so
`u < q` holds with probability ⌈q·2²⁴⌉/2²⁴, which exceeds q whenever q is off that grid
(for q = 2⁻⁶⁰ it is 2⁻²⁴). We compare uniform integers instead; see `inclusion_threshold`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from dpltm.errors import DpltmUserError

RANDOM_BITS = 62
"""k: each record draws an integer uniform on [0, 2^k). 2^62 fits an int64 `randint` bound."""


def inclusion_threshold(sample_rate: float) -> int:
    """t = ⌊q·2^k⌋: a record is in the batch iff its draw U ~ Uniform{0, …, 2^k − 1} is < t.

    So the realised inclusion probability is exactly t/2^k, and t/2^k ≤ q < (t + 1)/2^k: never
    above q, and below it by less than 2⁻⁶² (far below anything an accountant resolves).
    Exactness: q is a binary64 number and 2^k a power of two, so q·2^k is computed without
    rounding (no overflow for q ≤ 1; a subnormal q stays exact too, scaling only raises its
    exponent), and `math.floor` of an exact float is exact. q = 1 gives t = 2^k: every record.
    """
    return math.floor(float(sample_rate) * 2**RANDOM_BITS)


def poisson_sample(n: int, sample_rate: float, generator: torch.Generator,
                   device: torch.device | str = "cpu") -> Tensor:
    """Indices of the records in one Poisson batch (sorted, possibly empty).

    One draw of n int64 uniforms on [0, 2^62) from `generator` (on its own device, CPU or
    CUDA), compared with `inclusion_threshold(q)`: realised rate ≤ q exactly (see there).
    `torch.randint` reduces 64 random bits modulo the range; the range 2^62 divides 2^64, so
    the reduction is exactly uniform on both CPU and CUDA.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise DpltmUserError(f"sampling rate must lie in (0, 1], got {sample_rate}")
    draws = torch.randint(0, 2**RANDOM_BITS, (n,), generator=generator,
                          device=generator.device, dtype=torch.int64)
    keep = draws < inclusion_threshold(sample_rate)
    return keep.nonzero().squeeze(1).to(device)


MAX_RECORDS = 1 << 31
"""The most records a Poisson batch is drawn from: a draw is one int64 a record (16 GiB here), so a larger n is a
mistake to refuse in one line, not an allocation to fail."""

MAX_DRAWS_AT_ONCE = 1 << 24
"""Draws held at once when sampling an epoch ahead (128 MiB of int64)."""


def poisson_batches_at_once(n: int, sample_rate: float, steps: int, generator: torch.Generator,
                            device: torch.device | str = "cpu") -> list[Tensor]:
    """`steps` independent Poisson batches, drawn together: a couple of host synchronisations for the
    lot instead of one per step (what launch-free CUDA-graph steps need). Same rule as
    `poisson_sample`: each record is in each batch iff its uniform integer draw is < t."""
    if not 0.0 < sample_rate <= 1.0:
        raise DpltmUserError(f"sampling rate must lie in (0, 1], got {sample_rate}")
    threshold = inclusion_threshold(sample_rate)
    rows_per_block = max(1, MAX_DRAWS_AT_ONCE // max(n, 1))
    batches: list[Tensor] = []
    for start in range(0, steps, rows_per_block):
        rows = min(rows_per_block, steps - start)
        draws = torch.randint(0, 2**RANDOM_BITS, (rows, n), generator=generator, device=generator.device,
                              dtype=torch.int64)
        keep = draws < threshold
        counts = keep.sum(dim=1).tolist()
        columns = keep.nonzero()[:, 1]  # row-major: each row's indices, sorted
        batches.extend(part.to(device) for part in columns.split(counts))
    return batches


class PoissonBatches(IterableDataset[Tensor]):
    """`steps` Poisson batches of record indices, drawn from an explicit generator.

    With `shard` (the record indices one rank of a multi-device run owns; see
    dpltm.dp.distributed) only those records are sampled, each still with probability q: the
    union of the ranks' batches is then one Poisson batch of the whole dataset. With
    `epoch_at_once` each pass draws all its batches first (`poisson_batches_at_once`).
    """

    def __init__(self, n: int, sample_rate: float, steps: int, seed: int,
                 device: torch.device | str = "cpu", shard: Tensor | None = None,
                 epoch_at_once: bool = False) -> None:
        self.n, self.sample_rate, self.steps, self.seed = n, sample_rate, steps, seed
        self.epoch_at_once = epoch_at_once
        self.device = torch.device(device)
        self.shard = None if shard is None else shard.to(self.device)
        self.generator = torch.Generator(device=self.device if self.device.type == "cuda" else "cpu")
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Tensor]:
        if self.epoch_at_once:
            size = self.n if self.shard is None else len(self.shard)
            for index in poisson_batches_at_once(size, self.sample_rate, self.steps, self.generator, self.device):
                yield index if self.shard is None else self.shard[index]
            return
        for _ in range(self.steps):
            if self.shard is None:
                yield poisson_sample(self.n, self.sample_rate, self.generator, self.device)
            else:
                yield self.shard[poisson_sample(len(self.shard), self.sample_rate, self.generator, self.device)]


class BatchGather:
    """Rows `index` of a resident tensor, gathered into one buffer kept across steps.

    A fresh (B × features) tensor per step is a large allocation, which glibc serves with a new mmap
    and returns on free: every step then faults in its pages again. A DP step on 4096 ScatterNet
    feature rows (65 MB) spent 28 ms gathering them that way against 5 ms into a kept buffer
    (benchmarks/bench_masked_head.py). The returned tensor is a view of the buffer: valid until the
    next call, so a caller must not keep it across steps.
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def __call__(self, rows: Tensor, index: Tensor) -> Tensor:
        n = int(index.shape[0])
        buffer = self._buffer
        if (buffer is None or buffer.shape[0] < n or buffer.shape[1:] != rows.shape[1:]
                or buffer.dtype != rows.dtype or buffer.device != rows.device):
            capacity = max(n + n // 4, 1)  # room for the Poisson batch size's spread
            buffer = self._buffer = rows.new_empty((capacity, *rows.shape[1:]))
        return torch.index_select(rows, 0, index, out=buffer[:n])
