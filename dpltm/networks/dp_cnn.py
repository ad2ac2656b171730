"""The small CNN of the DP-SGD image benchmarks, as one file: `--arch dp-cnn`.

Conv(16, 8×8, stride 2, padding 3) → activation → max-pool 2×2/1 → Conv(32, 4×4, stride 2) →
activation → max-pool 2×2/1 → fully connected (32 by default, `--hidden`) → the classes. It is the
network of Opacus's and TF Privacy's MNIST examples; with `--activation tanh` it is the
tempered-sigmoid network of Papernot et al. 2021 ("Tempered sigmoid activations for deep learning
with differential privacy", AAAI), which reached 98.1 % on MNIST at ε = 2.93.

Nothing here knows about privacy: dpltm trains it through the DP engine's per-layer rules
(dpltm.dp.engine: exact per-sample norms for Conv2d and Linear; max pooling has no parameters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import activation_function, image_side

CONVOLUTIONS = ((16, 8, 2, 3), (32, 4, 2, 0))
"""(output channels, kernel side, stride, padding) of each convolution, input to output."""


def _after(side: int, kernel: int, stride: int, padding: int) -> int:
    """The side after a convolution, (side + 2p − k) // s + 1, and the 2×2, stride-1 max pooling that
    follows it (one less)."""
    return (side + 2 * padding - kernel) // stride


class DpCnn(nn.Module):
    """The network; parameters named conv.0/conv.1, hidden.i and output, as dpltm's masks are keyed."""

    def __init__(self, arch: Any, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.side = image_side(arch.in_features)
        side, channels = self.side, 1
        self.conv = nn.ModuleList()
        for out, kernel, stride, padding in CONVOLUTIONS:
            side = _after(side, kernel, stride, padding)
            if side < 1:
                raise DpltmUserError(f"--arch dp-cnn needs images of at least 14×14 pixels; these are "
                                     f"{self.side}×{self.side}")
            self.conv.append(nn.Conv2d(channels, out, kernel, stride=stride, padding=padding))
            channels = out
        widths = [channels * side * side, *arch.hidden, arch.num_classes]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-2], widths[1:-1]))
        self.output = nn.Linear(widths[-2], widths[-1])
        self.activation = activation_function(arch.activation)
        with torch.no_grad():  # PyTorch's default init (Kaiming-uniform), drawn from an explicit generator
            for layer in (*self.conv, *self.hidden, self.output):
                bound = 1.0 / layer.weight[0].numel() ** 0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], 1, self.side, self.side)
        for conv in self.conv:
            x = F.max_pool2d(self.activation(conv(x)), 2, 1)
        x = x.flatten(1)
        for layer in self.hidden:
            x = self.activation(layer(x))
        return self.output(x)


def build(arch: Any, generator: torch.Generator | None = None) -> nn.Module:
    return DpCnn(arch, generator)
