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
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from dpltm.dp.sampling import MAX_RECORDS, BatchGather
from dpltm.errors import DpltmUserError


def _as_pair(batch: Any, ids: bool = False) -> tuple[Tensor, Tensor]:
    """A collated batch as (features, labels); integer features become floats unless they are token ids (`ids`:
    the model embeds)."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        got = f"{len(batch)} field(s)" if isinstance(batch, (list, tuple)) else type(batch).__name__
        raise DpltmUserError(f"each record must be a (features, label) pair, got {got}")
    try:
        features, labels = (torch.as_tensor(t) for t in batch)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DpltmUserError(f"records must hold tensors or numbers: {str(exc).splitlines()[0][:120]}") from None
    if not features.is_floating_point() and not (ids and not features.is_complex()):
        features = features.float()
    if not labels.is_floating_point():
        labels = labels.long()
    return features, labels


class TensorRecords:
    """Records held as two tensors on one device."""

    def __init__(self, features: Tensor, labels: Tensor, dtype: torch.dtype | None = None) -> None:
        if features.shape[0] == 0:
            raise DpltmUserError("the training data is empty")
        features, labels = features.detach(), labels.detach()  # records are data: no autograd graph through them
        self.features = features if dtype is None or not features.is_floating_point() else features.to(dtype)
        self.labels = labels
        self.device = features.device
        self._gather = BatchGather()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """The rows `index`; the features are a view of a buffer kept across calls (valid until the next)."""
        return self._gather(self.features, index), self.labels.index_select(0, index)

    def chunks(self, size: int = 65536) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(self), size):
            yield self.features[start:start + size], self.labels[start:start + size]


class DatasetRecords:
    """Records read from a map-style Dataset by index, per batch (lazy: nothing is held)."""

    def __init__(self, dataset: Dataset, device: torch.device,  # type: ignore[type-arg]
                 collate: Callable[[list[Any]], Any] | None = None, dtype: torch.dtype | None = None,
                 ids: bool = False) -> None:
        self.dataset, self.device, self.dtype, self.ids = dataset, device, dtype, ids
        self.collate = collate or default_collate
        self._n = len(dataset)  # type: ignore[arg-type]
        if self._n == 0:
            raise DpltmUserError("the training dataset is empty")
        if self._n > MAX_RECORDS:  # each Poisson batch draws one int64 a record
            raise DpltmUserError(f"the training dataset says it holds {self._n} records; Poisson sampling draws "
                                 f"from at most {MAX_RECORDS}")
        self._empty = tuple(t[:0] for t in _as_pair(self.collate([dataset[0]]), ids))

    def __len__(self) -> int:
        return self._n

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        rows = index.tolist()
        if not rows:
            x, y = self._empty
        else:
            try:
                x, y = _as_pair(self.collate([self.dataset[i] for i in rows]), self.ids)
            except DpltmUserError:
                raise
            except Exception as exc:  # the user's dataset or collate: before the step, so nothing is spent
                first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
                raise DpltmUserError(f"reading a batch of the training dataset failed ({type(exc).__name__}: "
                                     f"{first}); the step was not taken") from exc
        if x.shape[0] != len(rows) or y.shape[0] != len(rows):
            # each sampled record must give exactly one row: a record that gave two would add two
            # clipped gradients, a sensitivity of 2C where the accountant assumes C
            raise DpltmUserError(f"the collate function turned {len(rows)} sampled records into {x.shape[0]} rows: "
                                 "each record must give exactly one row")
        if self.dtype is not None and x.is_floating_point():
            x = x.to(self.dtype)
        return x.to(self.device), y.to(self.device)

    def chunks(self, size: int = 4096) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, self._n, size):
            yield self.batch(torch.arange(start, min(start + size, self._n)))


Records = TensorRecords | DatasetRecords


def _whole_dataset_loader(loader: DataLoader) -> None:  # type: ignore[type-arg]
    """A loader lends its dataset only if it would have visited all of it: a custom sampler (a subset,
    weights) says which records to train on, and silently training on others would be wrong."""
    sampler = loader.sampler
    whole = isinstance(sampler, SequentialSampler) or (
        isinstance(sampler, RandomSampler) and not sampler.replacement
        and sampler.num_samples == len(loader.dataset))  # type: ignore[arg-type]
    if not whole or (loader.batch_sampler is not None and not isinstance(loader.batch_sampler, BatchSampler)):
        raise DpltmUserError("the DataLoader has its own sampler: dpltm Poisson-samples the loader's whole dataset, "
                             "so pass a loader without sampler/batch_sampler (or a Subset as its dataset)")


def training_records(data: Any, device: torch.device, in_memory: bool,
                     as_tensors: Callable[[Any, torch.device], tuple[Tensor, Tensor]],
                     dtype: torch.dtype | None = None, ids: bool = False) -> Records:
    """The run's records: tensors as given; a Dataset read once into tensors (`in_memory`, the fast
    path) or lazily; a DataLoader's dataset lazily with its collate_fn. Iterable streams are refused.
    Floating-point features are cast to `dtype` (the model's); integer features read lazily stay integers when
    they are token ids (`ids`: the model embeds), else become floats."""
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise DpltmUserError("the DataLoader streams an IterableDataset: Poisson sampling needs records it can "
                                 "fetch by index (a map-style Dataset)")
        _whole_dataset_loader(data)
        return DatasetRecords(data.dataset, device, data.collate_fn, dtype, ids)
    if isinstance(data, IterableDataset):
        raise DpltmUserError("an IterableDataset cannot be Poisson-sampled (a stream has no index to include "
                             "independently): pass a map-style Dataset")
    if isinstance(data, list) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        data = tuple(data)
    if isinstance(data, tuple) or in_memory:
        return TensorRecords(*as_tensors(data, device), dtype=dtype)
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise DpltmUserError(f"train must be (features, labels), a map-style Dataset or a DataLoader, got "
                             f"{type(data).__name__}")
    return DatasetRecords(data, device, dtype=dtype, ids=ids)
