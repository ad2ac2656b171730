"""Datasets as tensors: `load_dataset(name, split=...)` returns a `DatasetSplits`.

See `dpltm.data.loaders` for the split rule, `dpltm.data.catalog` for the datasets offered and
`dpltm.data.mnist` for md5 verification. The names below are imported on first use, so that the
torch-free catalogue can be read (by the CLI's choices) without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DATASETS", "SPLITS", "DatasetSplits", "LabeledTensors", "load_dataset"]

_HOMES = {"DATASETS": "dpltm.data.loaders", "SPLITS": "dpltm.data.loaders", "load_dataset": "dpltm.data.loaders",
          "DatasetSplits": "dpltm.data.types", "LabeledTensors": "dpltm.data.types"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'dpltm.data' has no attribute {name!r}")
