"""Poisson sampling: each record joins a batch independently with probability q.

This is the sampling the Poisson-subsampled Gaussian accountant assumes (Abadi et al. 2016;
Mironov et al. 2019; Zhu & Wang 2019). Batch sizes are Binomial(N, q); an empty batch is a
legal step (it still adds noise and is still counted). Shuffled fixed-size batches are a
different mechanism (Chua et al. 2024) and are not offered here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from dpltm.errors import DpltmUserError


def poisson_sample(n: int, sample_rate: float, generator: torch.Generator,
                   device: torch.device | str = "cpu") -> Tensor:
    """Indices of the records in one Poisson batch (sorted, possibly empty)."""
    if not 0.0 < sample_rate <= 1.0:
        raise DpltmUserError(f"sampling rate must lie in (0, 1], got {sample_rate}")
    keep = torch.rand(n, generator=generator, device=generator.device) < sample_rate
    return keep.nonzero().squeeze(1).to(device)


class PoissonBatches(IterableDataset[Tensor]):
    """`steps` Poisson batches of record indices, drawn from an explicit generator."""

    def __init__(self, n: int, sample_rate: float, steps: int, seed: int,
                 device: torch.device | str = "cpu") -> None:
        self.n, self.sample_rate, self.steps, self.seed = n, sample_rate, steps, seed
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device if self.device.type == "cuda" else "cpu")
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Tensor]:
        for _ in range(self.steps):
            yield poisson_sample(self.n, self.sample_rate, self.generator, self.device)
