"""The private training records of a library run, and how a Poisson batch is gathered from them.

Poisson sampling chooses record *indices* (each independently with probability q), so exactness
needs only a way to fetch records by index:

* `TensorRecords`: (features, labels) tensors on the device; a batch is one `index_select`
  (the fast path: no per-sample decoding).
* `DatasetRecords`: a map-style `Dataset` read lazily, `dataset[i]` per sampled index and
  collated, so data larger than memory and per-epoch augmentation in `__getitem__` work, with
  the sampling unchanged. A `DataLoader` contributes its dataset and `collate_fn`; its own
  batching is replaced by the run's Poisson sampler (any other batching is a different mechanism).

An `IterableDataset` cannot be Poisson-sampled (a stream has no index to include independently),
so it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from dpltm.errors import DpltmUserError


def _as_pair(batch: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise DpltmUserError("each record must be a (features, label) pair")
    features, labels = (torch.as_tensor(t) for t in batch)
    if not features.is_floating_point():
        features = features.float()
    if not labels.is_floating_point():
        labels = labels.long()
    return features, labels


class TensorRecords:
    """Records held as two tensors on one device."""

    def __init__(self, features: Tensor, labels: Tensor) -> None:
        self.features, self.labels = features, labels
        self.device = features.device

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        return self.features.index_select(0, index), self.labels.index_select(0, index)

    def chunks(self, size: int = 65536) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(self), size):
            yield self.features[start:start + size], self.labels[start:start + size]


class DatasetRecords:
    """Records read from a map-style Dataset by index, per batch (lazy: nothing is held)."""

    def __init__(self, dataset: Dataset, device: torch.device,  # type: ignore[type-arg]
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset, self.device = dataset, device
        self.collate = collate or default_collate
        self._n = len(dataset)  # type: ignore[arg-type]
        if self._n == 0:
            raise DpltmUserError("the training dataset is empty")
        self._empty = tuple(t[:0] for t in _as_pair(self.collate([dataset[0]])))

    def __len__(self) -> int:
        return self._n

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        rows = index.tolist()
        if not rows:
            x, y = self._empty
        else:
            x, y = _as_pair(self.collate([self.dataset[i] for i in rows]))
        return x.to(self.device), y.to(self.device)

    def chunks(self, size: int = 4096) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, self._n, size):
            yield self.batch(torch.arange(start, min(start + size, self._n)))


Records = TensorRecords | DatasetRecords


def training_records(data: Any, device: torch.device, in_memory: bool,
                     as_tensors: Callable[[Any, torch.device], tuple[Tensor, Tensor]]) -> Records:
    """The run's records: tensors as given; a Dataset read once into tensors (`in_memory`, the fast
    path) or lazily; a DataLoader's dataset lazily with its collate_fn. Iterable streams are refused."""
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise DpltmUserError("the DataLoader streams an IterableDataset: Poisson sampling needs records it can "
                                 "fetch by index (a map-style Dataset)")
        return DatasetRecords(data.dataset, device, data.collate_fn)
    if isinstance(data, IterableDataset):
        raise DpltmUserError("an IterableDataset cannot be Poisson-sampled (a stream has no index to include "
                             "independently): pass a map-style Dataset")
    if isinstance(data, tuple) or in_memory:
        return TensorRecords(*as_tensors(data, device))
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise DpltmUserError(f"train must be (features, labels), a map-style Dataset or a DataLoader, got "
                             f"{type(data).__name__}")
    return DatasetRecords(data, device)
