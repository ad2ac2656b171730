"""Mini-batches drawn from tensors that already sit on the device.

No DataLoader workers and no per-sample decoding: each batch is one `index_select` on the
device-resident dataset. The permutation comes from an explicit generator, so a round's batch
order depends only on its seed (what makes resumed runs reproduce uninterrupted ones).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from dpltm.data.types import LabeledTensors


class ShuffledBatches(IterableDataset[tuple[Tensor, Tensor]]):
    """`steps` batches of size `batch_size`, reshuffling at every pass over the data.

    Non-private training only: DP training uses Poisson sampling instead (see
    `dpltm.privacy`), because the privacy accountant assumes it.
    """

    def __init__(self, data: LabeledTensors, batch_size: int, steps: int, seed: int) -> None:
        self.data = data
        self.batch_size = min(batch_size, len(data))
        self.steps = steps
        self.seed = seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for index in self.indices():
            yield self.data.features.index_select(0, index), self.data.labels.index_select(0, index)

    def indices(self) -> Iterator[Tensor]:
        """The record indices of each batch, in order (on the data's device)."""
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        n = len(self.data)
        per_pass = n // self.batch_size
        device = self.data.labels.device
        order = torch.empty(0, dtype=torch.long)
        for step in range(self.steps):
            position = step % per_pass
            if position == 0:
                order = torch.randperm(n, generator=generator).to(device)
            yield order[position * self.batch_size : (position + 1) * self.batch_size]


class BlocksOfIndices(IterableDataset[Tensor]):
    """ShuffledBatches' batches as blocks of up to `block` rows of indices (a [k, batch] tensor):
    a CUDA-graph loop replays a block inside one Lightning step, paying Lightning's per-step work
    once per block."""

    def __init__(self, batches: ShuffledBatches, block: int) -> None:
        self.batches, self.block = batches, block

    def __len__(self) -> int:
        return -(-self.batches.steps // self.block)

    def __iter__(self) -> Iterator[Tensor]:
        rows: list[Tensor] = []
        for index in self.batches.indices():
            rows.append(index)
            if len(rows) == self.block:
                yield torch.stack(rows)
                rows = []
        if rows:
            yield torch.stack(rows)
