"""Poisson batches for a DataLoader: the sampler the DP accountant assumes, and a loader built on it.

Each record joins each batch independently with probability q = L/N (Abadi et al. 2016, §3.1: the moments
accountant's subsampled Gaussian assumes exactly this), so batch sizes vary and a batch may be empty; the
sampler, not the dataset, chooses the records. Torch-only: `DPCallback` (dpltm.lightning) reads these batches.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from dpltm.api_checks import check_count, check_seed
from dpltm.dp.sampling import MAX_RECORDS, poisson_sample
from dpltm.errors import DpltmUserError


class PoissonBatchSampler(Sampler[list[int]]):
    """`steps` Poisson batches per epoch: each of `n` records in each batch with probability q.

    It remembers the size of every batch it has handed out and not yet seen trained on, so that
    `DPCallback` can check that each step consumes one of its batches, in order."""

    def __init__(self, n: int, batch_size: int, steps: int | None = None, seed: int | None = None) -> None:
        n = check_count(n, "n", minimum=2, maximum=MAX_RECORDS)
        batch_size = check_count(batch_size, "batch_size")
        if not batch_size < n:
            raise DpltmUserError(f"batch_size must lie in (0, {n}), got {batch_size}")
        if steps is not None:
            steps = check_count(steps, "steps")
        if seed is not None:
            seed = check_seed(seed, "seed")
        self.n, self.batch_size = n, batch_size
        self.sample_rate = batch_size / n
        self.steps = steps if steps is not None else math.ceil(n / batch_size)
        self.seed = seed  # a user's seed (reproducible batches) or None (OS CSPRNG, not kept)
        self.generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
        self._issued: deque[int] = deque()

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        self._issued.clear()  # a new pass: batches drawn ahead for an abandoned pass are never trained on
        for _ in range(self.steps):
            index = poisson_sample(self.n, self.sample_rate, self.generator).tolist()
            self._issued.append(len(index))
            yield index

    def next_issued(self) -> int | None:
        """The size of the oldest batch handed out and not yet trained on (None: none is pending)."""
        return self._issued.popleft() if self._issued else None


def poisson_loader(dataset: Dataset, batch_size: int, seed: int | None = None, **kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
    """A DataLoader of Poisson batches (expected size `batch_size`); an empty batch is a batch of zero
    rows (it still takes a noisy step), shaped like the dataset's first item. Map-style datasets of
    any size work (items are read per batch), with per-epoch augmentation in `__getitem__`; sampling
    stays exact Poisson because the sampler, not the dataset, chooses the records."""
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2 and all(isinstance(t, Tensor) for t in dataset):
        raise DpltmUserError("poisson_loader takes a Dataset, not a (features, labels) pair: wrap it as "
                             "torch.utils.data.TensorDataset(features, labels)")
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise DpltmUserError("poisson_loader needs a map-style dataset (with __len__ and __getitem__): Poisson "
                             "sampling chooses each record independently, which an iterable stream cannot do")
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        raise DpltmUserError(f"the dataset has {n} record(s): Poisson sampling needs at least 2")
    chosen = [k for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last") if k in kwargs]
    if chosen:
        raise DpltmUserError(f"poisson_loader chooses the batches itself: drop {'/'.join(chosen)} from its keyword "
                             "arguments")
    user_collate = kwargs.pop("collate_fn", None) or default_collate
    example = user_collate([dataset[0]])

    def collate(items: list[Any]) -> Any:
        if items:
            return user_collate(items)
        return _empty_like(example)

    return DataLoader(dataset, batch_sampler=PoissonBatchSampler(n, batch_size, seed=seed), collate_fn=collate,
                      **kwargs)


def _empty_like(example: Any) -> Any:
    """A batch of zero rows shaped like `example` (tensors, or lists/tuples/dicts of them)."""
    if isinstance(example, Tensor):
        return example[:0]
    if isinstance(example, Mapping):
        return {k: _empty_like(v) for k, v in example.items()}
    if isinstance(example, (list, tuple)):
        return type(example)(_empty_like(v) for v in example) if isinstance(example, list) else \
            tuple(_empty_like(v) for v in example)
    return example


def batch_rows(batch: Any) -> int:
    """The number of records in a batch: the first dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return batch_rows(value)
        except DpltmUserError:
            continue
    raise DpltmUserError("the training batch holds no tensor: DPCallback cannot tell its size")
