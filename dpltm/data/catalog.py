"""The datasets dpltm reads, one entry each: the one list every front end reads.

Adding a dataset: a loader `load_portion(root, portion) -> Portion` (dpltm/data/mnist.py and
dpltm/data/tabular.py hold today's), one `DatasetEntry` line below, and its settings file
configs/datasets/<name>.yaml. The CLI's `--dataset` choices, the loaders' shapes and the input
normalisation an export records are derived from this table. Nothing heavy is imported here (no
torch, no numpy), so `dpltm --help` stays quick; a loader is imported when a dataset is read.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    num_features: int
    num_classes: int
    loader: str
    """`module:function` reading one official portion: `function(root, portion)`, or with `loader_args`
    first."""
    input_normalisation: dict[str, object]
    """How a raw record becomes the network's input (feature = raw · scale + offset): what `dpltm export`
    writes beside the weights, so a user can feed new records exactly as training did."""
    loader_args: tuple[Any, ...] = field(default=())

    def load_portion(self) -> Any:
        module, name = self.loader.split(":")
        function = getattr(importlib.import_module(module), name)
        return partial(function, *self.loader_args) if self.loader_args else function


_IMAGES = {"raw": "28×28 grey pixels, uint8 0..255", "layout": "row-major, flattened to 784", "scale": 1 / 255,
           "offset": 0.0}

DATASET_ENTRIES: dict[str, DatasetEntry] = {entry.name: entry for entry in (
    DatasetEntry("mnist", 784, 10, "dpltm.data.mnist:load_portion", _IMAGES, ("mnist",)),
    DatasetEntry("fashion-mnist", 784, 10, "dpltm.data.mnist:load_portion", _IMAGES, ("fashion-mnist",)),
    DatasetEntry("kmnist", 784, 10, "dpltm.data.mnist:load_portion", _IMAGES, ("kmnist",)),
    DatasetEntry("har", 561, 6, "dpltm.data.tabular:load_har",
                 {"raw": "561 features of UCI HAR's X_*.txt (already scaled to [-1, 1] by the archive)",
                  "layout": "the file's column order", "scale": 1.0, "offset": 0.0}),
    DatasetEntry("isolet", 617, 26, "dpltm.data.tabular:load_isolet",
                 {"raw": "617 features of ISOLET's *.data (already scaled to [-1, 1] by the archive)",
                  "layout": "the file's column order", "scale": 1.0, "offset": 0.0}),
    DatasetEntry("digits", 64, 10, "dpltm.data.tabular:load_digits",
                 {"raw": "8×8 pixel counts 0..16 (scikit-learn's digits.csv)", "layout": "row-major, flattened to 64",
                  "scale": 1 / 16, "offset": 0.0}),
)}
