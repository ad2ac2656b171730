"""`load_dataset`: one entry point from a dataset name to train/val/test tensors.

Split rule: with split="train" the pool is the official training portion and the official
test portion is the test set. Otherwise ("test", "all", or data without an official split)
the pool is divided 80/20 (in expectation) into training rows and test set. Then, in
expectation, `val_fraction` of the training rows is held out as the validation set.

Both hold-outs are per record (`splits.record_split`): a record's side is a keyed hash of its
own content and the seed, so datasets that differ in one record give training sets that
differ in at most that record, and the DP guarantee on the training set carries over to the
data the user holds. (Scheme v1 used class-stratified quotas, which reassign many records
when one is added.) Sizes are therefore binomial, not exact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpltm.choices import Split
from dpltm.data.catalog import DATASET_ENTRIES
from dpltm.data.sources import Portion
from dpltm.data.splits import derive_seed, record_split
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.paths import resolve_data_dir

DATASETS: tuple[str, ...] = tuple(DATASET_ENTRIES)
SPLITS: tuple[str, ...] = tuple(choice.value for choice in Split)
POOL_TEST_FRACTION = 0.2
MAX_VAL_FRACTION = 0.5
# Bump when the split or normalisation rules change, so old fingerprints stop matching.
SPLIT_SCHEME = "dpltm-split-v2"  # v2: per-record keyed-hash hold-outs


@dataclass(frozen=True)
class DatasetSpec:
    """What is fixed about a dataset, and how to read one official portion of it."""

    num_features: int
    num_classes: int
    load_portion: Callable[[Path, str], Portion]


#: How a raw record becomes the network's input, per dataset (dpltm/data/catalog.py).
INPUT_NORMALISATION: dict[str, dict[str, object]] = {n: e.input_normalisation for n, e in DATASET_ENTRIES.items()}

SPECS: dict[str, DatasetSpec] = {n: DatasetSpec(e.num_features, e.num_classes, e.load_portion())
                                 for n, e in DATASET_ENTRIES.items()}


def check_load_options(name: str, split: str, val_fraction: float, seed: int) -> None:
    """`load_dataset`'s arguments checked before anything is read: one line that lists what is allowed."""
    if name not in SPECS:
        raise DpltmUserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise DpltmUserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, numbers.Real)
        or not 0.0 <= float(val_fraction) < MAX_VAL_FRACTION
    ):
        raise DpltmUserError(
            f"val_fraction must be a number in [0, {MAX_VAL_FRACTION}), got {val_fraction!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise DpltmUserError(f"seed must be an integer, got {seed!r}")


def _subset(portion: Portion, rows: np.ndarray) -> Portion:
    return Portion(portion.features[rows], portion.labels[rows], portion.files, portion.official)


def _concat(first: Portion, second: Portion) -> Portion:
    return Portion(
        np.concatenate([first.features, second.features]),
        np.concatenate([first.labels, second.labels]),
        first.files + second.files,
        first.official and second.official,
    )


def _train_and_test(
    spec: DatasetSpec, root: Path, split: str, seed: int
) -> tuple[Portion, Portion]:
    """The training pool and the test set, by the split rule in the module docstring."""
    if split == "train":
        return spec.load_portion(root, "train"), spec.load_portion(root, "test")
    if split == "test":
        pool = spec.load_portion(root, "test")
    else:
        pool = _concat(spec.load_portion(root, "train"), spec.load_portion(root, "test"))
    train_rows, test_rows = record_split(
        pool.features, pool.labels, POOL_TEST_FRACTION, derive_seed(seed, "test")
    )
    return _subset(pool, train_rows), _subset(pool, test_rows)


def fingerprint(
    name: str, split: str, val_fraction: float, seed: int, files: tuple[tuple[str, str], ...]
) -> str:
    """16 hex digits over the options and the md5 of every raw file used (not their paths)."""
    payload = {
        "scheme": SPLIT_SCHEME,
        "dataset": name,
        "split": split,
        "val_fraction": float(val_fraction).hex(),
        "seed": int(seed),
        "files": sorted(set(files)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _own_tensor(array: np.ndarray, dtype: type) -> torch.Tensor:
    """A tensor that never aliases the (read-only) decode cache."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _tensors(portion: Portion, device: torch.device) -> LabeledTensors:
    features = _own_tensor(portion.features, np.float32)
    labels = _own_tensor(portion.labels, np.int64)
    return LabeledTensors(features.to(device), labels.to(device))


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DpltmUserError(f"bad device {device!r}: {exc}") from None


_reused: dict[tuple[object, ...], DatasetSplits] | None = None


@contextlib.contextmanager
def each_dataset_loaded_once() -> Iterator[None]:
    """Within this block `load_dataset` gives the splits it made before for the same arguments: the stages
    of one `dpltm run` (checks, the noise-aware choice, training) read, decode, hash and split each dataset
    once, and all see the same records. Nothing mutates a `DatasetSplits`' tensors (stages make new ones)."""
    global _reused
    outer = _reused
    _reused = {} if outer is None else outer
    try:
        yield
    finally:
        _reused = outer


def load_dataset(
    name: str,
    *,
    split: str = "train",
    data_dir: str | Path | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> DatasetSplits:
    """Load dataset `name` as train/val/test tensors on `device` (rules: module docstring)."""
    check_load_options(name, split, val_fraction, seed)
    target = _device(device)
    root = resolve_data_dir(data_dir)
    if _reused is None:
        return _load(name, split, root, float(val_fraction), int(seed), target)
    key = (name, split, str(root.resolve()), float(val_fraction).hex(), int(seed), str(target))
    if key not in _reused:
        _reused[key] = _load(name, split, root, float(val_fraction), int(seed), target)
    return _reused[key]


def _load(name: str, split: str, root: Path, val_fraction: float, seed: int, target: torch.device) -> DatasetSplits:
    spec = SPECS[name]
    train, test = _train_and_test(spec, root, split, int(seed))
    kept, held = record_split(
        train.features, train.labels, float(val_fraction), derive_seed(seed, "val")
    )
    try:
        return DatasetSplits(
            name=name,
            source_split=split,
            train=_tensors(_subset(train, kept), target),
            val=_tensors(_subset(train, held), target),
            test=_tensors(test, target),
            num_features=spec.num_features,
            num_classes=spec.num_classes,
            fingerprint=fingerprint(name, split, val_fraction, int(seed), train.files + test.files),
            seed=int(seed),
            val_fraction=float(val_fraction),
            official_files=train.official and test.official,
        )
    except (RuntimeError, AssertionError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"cannot put {name} on device {target}: {reason}") from None
