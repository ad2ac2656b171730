"""Datasets as tensors: the shape every loader returns and every stage consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

    `fingerprint` identifies the exact bytes and split that produced these tensors, so a
    checkpoint can say which data shaped it.
    """

    name: str
    source_split: str
    train: LabeledTensors
    val: LabeledTensors
    test: LabeledTensors
    num_features: int
    num_classes: int
    fingerprint: str

    def to(self, device: torch.device | str) -> DatasetSplits:
        return DatasetSplits(
            name=self.name,
            source_split=self.source_split,
            train=self.train.to(device),
            val=self.val.to(device),
            test=self.test.to(device),
            num_features=self.num_features,
            num_classes=self.num_classes,
            fingerprint=self.fingerprint,
        )

    def summary(self) -> dict[str, object]:
        """What a checkpoint records about the data (no tensors)."""
        return {
            "dataset": self.name,
            "split": self.source_split,
            "fingerprint": self.fingerprint,
            "num_features": self.num_features,
            "num_classes": self.num_classes,
            "n_train": len(self.train),
            "n_val": len(self.val),
            "n_test": len(self.test),
        }
