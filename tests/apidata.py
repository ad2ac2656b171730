"""Small data and a small model for the library API's tests."""

from __future__ import annotations

import torch
from torch import nn


def blobs(n: int, seed: int, d: int = 10, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """n records of `classes` Gaussian clusters in d dimensions (fixed centres)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=torch.Generator().manual_seed(99)) * 3
    labels = torch.randint(0, classes, (n,), generator=g)
    return centers[labels] + torch.randn(n, d, generator=g), labels


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
