"""Networks over a fixed ScatterNet front end: `--arch scatter-linear` and `--arch scatter-cnn`.

Tramèr & Boneh (ICLR 2021, "Differentially Private Learning Needs Better Features (or Much More
Data)") put a wavelet scattering transform in front of a small head and train only the head with
DP-SGD. The transform has no learned weights and reads no data: it is a fixed function of one record,
so computing it costs no privacy, and everything DP-SGD protects is in the head.

The front end (`ScatterFront`): the 2-D scattering with J = 2 (Mallat 2012; Bruna & Mallat 2013;
kymatio's filters and maps, computed by dpltm's batched `dpltm.networks.scattering`) over each
side×side image — 81 maps (order 0, 16 of order 1, 64 of order 2) of side/4 × side/4 — then group
normalisation of each record by itself (27 groups of 3 maps, no affine parameters:
Tramèr & Boneh's choice for MNIST-like images). Normalising one record by its own statistics is a
function of that record only; dataset-wide feature statistics of the private set would be a
release of the private data that would have to be paid for, so dpltm does not compute them.

The front end holds no parameters and no buffers (its filters are built per device on first use and
kept beside the module, never in a state_dict): it is excluded from the masks, the clipping, the
noise, the parameter count and every file. The heads, named as dpltm's masks are keyed:
- scatter-linear: one linear layer `output` (zero-initialised: Tramèr & Boneh's linear model is convex,
  and a zero start adds nothing for the noise to undo);
- scatter-mlp: fully connected layers over the features (100 by default, `--hidden`), then the classes:
  the head whose first layer a ticket can prune and public data can train;
- scatter-cnn: Tramèr & Boneh's CNN over the 81 × 7 × 7 maps (their code, `MNIST_CNN` with
  in_channels = 81): Conv(16, 3×3, stride 2, padding 1) → activation → Conv(32, 3×3, padding 1) →
  activation → fully connected (32 by default, `--hidden`) → activation → the classes. With
  `--activation tanh` it is theirs.

Training reads cached features (dpltm.feature_cache: the front end runs once per record), so `forward`
takes either raw records (side² values: the front end runs) or their features (81·(side/4)² values).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import activation_function, image_side
from dpltm.networks.scattering import SCALES, Scattering2D

ANGLES = 8
"""L: the wavelets' orientations (kymatio's default)."""
CHANNELS = 1 + SCALES * ANGLES + ANGLES**2 * SCALES * (SCALES - 1) // 2
"""Maps per image at order 2: 1 + J·L + L²·J(J−1)/2 = 81 for J = 2, L = 8."""
GROUPS = 27
"""Per-record group normalisation: 81 maps in 27 groups of 3 (Tramèr & Boneh)."""
NORM_EPS = 1e-5
IMPLEMENTATION = "dpltm.networks.scattering 1"
"""Which code computed the maps (kymatio's filters, dpltm's batched transform): part of a feature cache's key,
so features cached by another implementation are recomputed, not mixed in."""
HEAD_CONVOLUTIONS = ((16, 3, 2, 1), (32, 3, 1, 1))
"""scatter-cnn's convolutions: (output channels, kernel side, stride, padding), input to output."""


def scattering_class() -> Any:
    """kymatio's 2-D torch scattering (the reference dpltm's own `Scattering2D` is tested against), imported
    deliberately from its own module: kymatio 0.3's top-level package (and `kymatio.torch`) import its 3-D
    filter bank, which needs `scipy.special.sph_harm`, gone from SciPy ≥ 1.15; the 2-D torch front end
    needs none of it."""
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as exc:
        raise _kymatio_missing(exc) from None
    return ScatteringTorch2D


def _kymatio_missing(exc: ImportError) -> DpltmUserError:
    return DpltmUserError(f"the scattering front end needs kymatio 0.3 (pip install 'kymatio>=0.3,<0.4'): "
                          f"{str(exc).splitlines()[0]}")


def scattering_for(side: int, device: torch.device) -> Scattering2D:
    """dpltm's batched scattering (`dpltm.networks.scattering`) over kymatio's filter bank: kymatio's
    features in about 0.6× its time on 2 CPU cores."""
    try:
        return Scattering2D(side, ANGLES, device)
    except ImportError as exc:
        raise _kymatio_missing(exc) from None


class ScatterFront(nn.Module):
    """Records (B, side²) → scattering features (B, 81·(side/4)²), each record by itself. No parameters,
    no buffers: nothing here is trained, stored or released."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.side = image_side(in_features)
        if self.side % 2**SCALES or self.side < 2**(SCALES + 1):
            raise DpltmUserError(f"the scattering front end needs square images whose side is a multiple of "
                                 f"{2**SCALES} and at least {2**(SCALES + 1)}; these are {self.side}×{self.side}")
        self.in_features = in_features
        self.out_side = self.side // 2**SCALES
        self.out_shape = (CHANNELS, self.out_side, self.out_side)
        self.out_features = CHANNELS * self.out_side**2
        self.__dict__["_transforms"] = {}  # per device; a plain attribute, so never a buffer or a state_dict entry

    def settings(self) -> dict[str, Any]:
        """Everything the features depend on besides the record: what a feature cache is keyed by."""
        from kymatio.version import version

        return {"transform": "scattering2d", "implementation": IMPLEMENTATION, "J": SCALES, "L": ANGLES,
                "max_order": 2, "side": self.side,
                "norm": f"group_norm({GROUPS}, affine=False, eps={NORM_EPS})", "kymatio": version}

    def _transform(self, device: torch.device) -> Any:
        transforms: dict[str, Any] = self.__dict__["_transforms"]
        key = str(device)
        if key not in transforms:
            transforms[key] = scattering_for(self.side, device)
        return transforms[key]

    @torch.no_grad()
    def forward(self, x: Tensor) -> Tensor:
        images = x.reshape(x.shape[0], self.side, self.side).float()
        maps = self._transform(x.device)(images).reshape(x.shape[0], *self.out_shape)
        return F.group_norm(maps, GROUPS, eps=NORM_EPS).flatten(1).to(x.dtype)


class ScatterNet(nn.Module):
    """The front end and a head; `forward` takes raw records or their cached features."""

    def __init__(self, arch: Any, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.front = ScatterFront(arch.in_features)
        self.activation = activation_function(arch.activation)
        self.conv = nn.ModuleList()
        self.hidden = nn.ModuleList()
        if arch.name == "scatter-cnn":
            channels, side = CHANNELS, self.front.out_side
            for out, kernel, stride, padding in HEAD_CONVOLUTIONS:
                self.conv.append(nn.Conv2d(channels, out, kernel, stride=stride, padding=padding))
                channels, side = out, (side + 2 * padding - kernel) // stride + 1
            widths = [channels * side * side, *arch.hidden]
            self.hidden.extend(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
            last = widths[-1]
        elif arch.name == "scatter-mlp":
            if not arch.hidden:
                raise DpltmUserError("--arch scatter-mlp needs at least one hidden layer (--hidden); with none it is "
                                     "--arch scatter-linear")
            widths = [self.front.out_features, *arch.hidden]
            self.hidden.extend(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
            last = widths[-1]
        else:
            if arch.hidden:
                raise DpltmUserError("--arch scatter-linear is one linear layer over the features: it takes no "
                                     "--hidden (use --arch scatter-cnn for a deeper head)")
            last = self.front.out_features
        self.output = nn.Linear(last, arch.num_classes)
        with torch.no_grad():  # PyTorch's default init (Kaiming-uniform), drawn from an explicit generator
            for layer in (*self.conv, *self.hidden, self.output):
                bound = 1.0 / layer.weight[0].numel() ** 0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
            if not self.conv and not self.hidden:  # the convex linear model starts at zero
                self.output.weight.zero_()
                self.output.bias.zero_()

    @property
    def fully_connected(self) -> bool:
        """scatter-linear and scatter-mlp: linear layers over the features (what dpltm.dp.batched stacks)."""
        return not self.conv

    def layers_in_order(self) -> list[tuple[str, nn.Linear]]:
        """(mask name, layer) of the head's linear layers, features to classes."""
        return [*((f"hidden.{i}.weight", layer) for i, layer in enumerate(self.hidden)), ("output.weight", self.output)]

    def is_activation_after(self, index: int) -> bool:
        """Whether the activation follows linear layer `index` (every hidden layer; not the output)."""
        return index < len(self.hidden)

    def conv_layers_in_order(self) -> list[tuple[str, nn.Conv2d]]:
        """None for the fused DP step (dpltm.dp.ghost), which takes a fully connected head over the features as
        it takes an MLP; scatter-cnn's convolutions train through the DP engine's rules."""
        if self.conv:
            raise TypeError("scatter-cnn trains through the DP engine (dpltm.dp.engine), not the fused step")
        return []

    def features(self, x: Tensor) -> Tensor:
        """The head's input: `x` itself when it already holds features, else the front end's output."""
        if x.shape[-1] == self.front.out_features:
            return x
        if x.shape[-1] == self.front.in_features:
            return self.front(x)
        raise DpltmUserError(f"this network takes records of {self.front.in_features} values or their "
                             f"{self.front.out_features} scattering features, not {x.shape[-1]}")

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        if self.conv:
            x = x.reshape(x.shape[0], *self.front.out_shape)
            for conv in self.conv:
                x = self.activation(conv(x))
            x = x.flatten(1)
        for layer in self.hidden:
            x = self.activation(layer(x))
        return self.output(x)


def build(arch: Any, generator: torch.Generator | None = None) -> nn.Module:
    return ScatterNet(arch, generator)
