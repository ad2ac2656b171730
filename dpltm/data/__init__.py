"""Datasets as tensors: `load_dataset(name, split=...)` returns a `DatasetSplits`.

See `dpltm.data.loaders` for the split rule and `dpltm.data.mnist` for md5 verification.
"""

from dpltm.data.loaders import DATASETS, SPLITS, load_dataset
from dpltm.data.types import DatasetSplits, LabeledTensors

__all__ = ["DATASETS", "SPLITS", "DatasetSplits", "LabeledTensors", "load_dataset"]
