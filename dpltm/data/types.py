"""Datasets as tensors: the shape every loader returns and every stage consumes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

USER_DATA_NOTE = ("user data: not recorded (a fingerprint of files other than the official published ones "
                  "is a function of the private records)")
OFFICIAL_NOTE = "official files: every raw file matched its published md5"


@dataclass(frozen=True)
class LabeledTensors:
    """Features (float32, [N, D], already normalised) and labels (int64, [N]) on one device."""

    features: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str) -> LabeledTensors:
        return LabeledTensors(self.features.to(device), self.labels.to(device))


@dataclass(frozen=True)
class DatasetSplits:
    """One dataset split three ways. `val` is held out of `train`; `test` only reports.

    `fingerprint` identifies the exact bytes and split that produced these tensors, so ticket sets
    can be resumed and checked against the private data record by record. It is a function of the
    records: released files carry it only for `official_files` (`summary`, dpltm.data.release).
    `seed` and `val_fraction` are the split settings that made the hold-outs (None: not loaded
    from files).
    """

    name: str
    source_split: str
    train: LabeledTensors
    val: LabeledTensors
    test: LabeledTensors
    num_features: int
    num_classes: int
    fingerprint: str
    seed: int | None = None
    val_fraction: float | None = None
    official_files: bool = False
    """Every raw file matched its official published md5: the fingerprint is then public."""

    def to(self, device: torch.device | str) -> DatasetSplits:
        return replace(self, train=self.train.to(device), val=self.val.to(device), test=self.test.to(device))

    def summary(self) -> dict[str, Any]:
        """What a released file (model, export, private ticket) records about the data: settings
        and counts, and the fingerprint only for official files (dpltm.data.release)."""
        return {
            "dataset": self.name,
            "split": self.source_split,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "official_files": self.official_files,
            "fingerprint": self.fingerprint if self.official_files else None,
            "fingerprint_note": OFFICIAL_NOTE if self.official_files else USER_DATA_NOTE,
            "num_features": self.num_features,
            "num_classes": self.num_classes,
            "n_train": len(self.train),
            "n_val": len(self.val),
            "n_test": len(self.test),
        }

    def ticket_set_summary(self) -> dict[str, Any]:
        """A ticket set's record of its data, with the fingerprint: generation saw the data without
        privacy anyway, and resuming and the public-ticket overlap check need it."""
        return {**self.summary(), "fingerprint": self.fingerprint,
                "fingerprint_note": "ticket set: kept for resuming and the overlap check"}
