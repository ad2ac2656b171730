"""The built-in networks of the LeNet family (the paper's LeNet-300-100 and LeNet-5) as plain `nn.Module`s, and
`Architecture`, what rebuilds any network dpltm trains (a LeNet, or a network of its own file under
dpltm/networks/, named by dpltm/architectures.py)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.architectures import ARCHITECTURES
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, full_masks, prunable_weights

#: The largest network dpltm builds. 10⁸ parameters are 400 MB of float32 weights, before the
#: masks, the optimiser state and the θ0 and mask copies a ticket file keeps (the paper's
#: LeNet-300-100 has 266 610); `--hidden 100000,100000` would ask for 40 GB.
MAX_PARAMETERS = 10**8

#: The hidden layers' activation, by name. ReLU is the paper's; tanh is bounded, which helps under
#: DP (Papernot et al. 2021, "Tempered sigmoid activations for deep learning with differential
#: privacy": clipping loses less when activations cannot explode).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "tanh": torch.tanh}


def _whole(value: object, field: str) -> int:
    """A stored whole number as an int: ints only (not bools, strings or fractions)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"architecture field {field} must be a whole number, got {value!r}")
    return value


def activation_function(name: str) -> Callable[[Tensor], Tensor]:
    """The activation called `name`; an unknown name is one line."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise DpltmUserError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}") from None


def parameter_count(in_features: int, hidden: Sequence[int], num_classes: int,
                    project_to: int | None = None) -> int:
    """Weights and biases of the network `Architecture` describes (exact Python ints)."""
    widths = [int(in_features), *([int(project_to)] if project_to is not None else []),
              *(int(h) for h in hidden), int(num_classes)]
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(widths, widths[1:]))


def check_network_size(in_features: int, hidden: Sequence[int], num_classes: int,
                       project_to: int | None = None) -> None:
    """One-line refusal, before anything is allocated, of a network over MAX_PARAMETERS."""
    count = parameter_count(in_features, hidden, num_classes, project_to)
    if count > MAX_PARAMETERS:
        layers = ",".join(str(int(h)) for h in hidden)
        extra = f" with --project-to {project_to}" if project_to is not None else ""
        raise DpltmUserError(
            f"--hidden {layers}{extra} makes a network of {count:.3g} parameters "
            f"({in_features} inputs); dpltm builds at most {MAX_PARAMETERS:.0e}"
        )


ARCHS: dict[str, tuple[tuple[int, int], ...]] = {name: entry.conv for name, entry in ARCHITECTURES.items()}
"""`--arch`: the convolutional front of each built-in network (dpltm/architectures.py)."""

ARCH_DEFAULT_HIDDEN = {name: entry.default_hidden for name, entry in ARCHITECTURES.items()
                       if entry.default_hidden is not None}


def image_side(in_features: int) -> int:
    """The side of the square single-channel images a convolutional front reads (784: 28×28)."""
    side = math.isqrt(in_features)
    if side * side != in_features:
        raise DpltmUserError(f"a convolutional network needs square single-channel images; {in_features} features "
                             "are not (use --arch mlp)")
    return side


@dataclass(frozen=True)
class Architecture:
    """Everything needed to rebuild the network; stored in every checkpoint."""

    in_features: int
    hidden: tuple[int, ...]
    num_classes: int
    project_to: int | None = None
    activation: str = "relu"
    """Hidden layers' activation (a key of ACTIVATIONS)."""
    conv: tuple[tuple[int, int], ...] = ()
    """Convolutional front (ARCHS): (output channels, kernel side) per layer; () for the MLP."""
    name: str | None = None
    """An architecture of its own file (`dpltm.architectures`: an entry with a `module`), built by that
    module's `build`; None for the LeNet family (`conv` and `hidden` describe it)."""

    def __post_init__(self) -> None:
        activation_function(self.activation)
        if self.name is not None:
            entry = ARCHITECTURES.get(self.name)
            if entry is None:
                raise DpltmUserError(f"unknown architecture {self.name!r}")
            if entry.module is None:
                raise DpltmUserError(f"architecture name {self.name!r}: {self.name} is a built-in network, described "
                                     "by its layers (conv, hidden) and not by a name")
            if self.conv:
                raise DpltmUserError(f"--arch {self.name} has its own layers: its record lists no 'conv'")
            if self.project_to is not None:
                raise DpltmUserError("--project-to applies to --arch mlp")
            if any(int(s) <= 0 for s in (self.in_features, *self.hidden, self.num_classes)):
                raise DpltmUserError(f"layer sizes must be positive, got {[self.in_features, *self.hidden]}")
            with torch.device("meta"):  # the module's own checks (image shape, widths), no memory used
                try:
                    network = build_network(self)
                except (RuntimeError, IndexError, ValueError, TypeError) as exc:
                    raise DpltmUserError(f"--arch {self.name} cannot be built with these sizes "
                                         f"({str(exc).splitlines()[0][:100]})") from None
            count = sum(p.numel() for p in network.parameters())
            if count > MAX_PARAMETERS:
                raise DpltmUserError(f"--arch {self.name} with --hidden {','.join(map(str, self.hidden))} makes a "
                                     f"network of {count:.3g} parameters; dpltm builds at most {MAX_PARAMETERS:.0e}")
            return
        if self.conv:
            if self.project_to is not None:
                raise DpltmUserError("--project-to applies to the MLP (--arch mlp)")
            side = image_side(self.in_features)
            for _, kernel in self.conv:
                side = (side - kernel + 1) // 2
                if side < 1:
                    kernels = ", ".join(f"{k}×{k}" for _, k in self.conv)
                    first = image_side(self.in_features)
                    raise DpltmUserError(f"images of {first}×{first} pixels are too small for this network's "
                                         f"convolutions ({kernels}, each then 2×2 pooling; LeNet-5 takes 28×28)")
        sizes = [self.in_features, *self.hidden, self.num_classes]
        if self.project_to is not None:
            sizes.append(self.project_to)
        if any(int(s) <= 0 for s in sizes):
            raise DpltmUserError(f"layer sizes must be positive, got {sizes}")
        check_network_size(self.in_features, self.hidden, self.num_classes, self.project_to)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        if self.conv:
            d["conv"] = [list(c) for c in self.conv]
        else:
            del d["conv"]  # an MLP's record is what it has always been
        if self.name is None:
            del d["name"]  # the LeNet family's record is what it has always been
        return d

    @property
    def is_mlp(self) -> bool:
        """LeNet-300-100's family (fully connected layers only): what the stacked candidates, the noise
        geometries and cross-architecture transfer handle."""
        return not self.conv and self.name is None

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Architecture:
        """The record as stored; a field of the wrong type (a string "64", a number for a list) is a ValueError
        naming it, never coerced ("300" would otherwise become the widths 3, 0, 0)."""
        project_to = d.get("project_to")
        hidden, conv = d["hidden"], d.get("conv", [])
        if not isinstance(hidden, list | tuple) or not isinstance(conv, list | tuple):
            raise ValueError("architecture fields hidden and conv must be lists")
        if not all(isinstance(c, list | tuple) and len(c) == 2 for c in conv):
            raise ValueError("architecture field conv must list (channels, kernel) pairs")
        activation, name = d["activation"], d.get("name")
        if not isinstance(activation, str) or not (name is None or isinstance(name, str)):
            raise ValueError("architecture fields activation and name must be strings")
        return cls(
            in_features=_whole(d["in_features"], "in_features"),
            hidden=tuple(_whole(h, "hidden") for h in hidden),
            num_classes=_whole(d["num_classes"], "num_classes"),
            project_to=None if project_to is None else _whole(project_to, "project_to"),
            activation=activation,
            conv=tuple((_whole(c[0], "conv"), _whole(c[1], "conv")) for c in conv),
            name=name,
        )

    def conv_shapes(self) -> list[tuple[int, int, int, int]]:
        """(out, in, k, k) of each convolution's weight, input to output."""
        shapes, channels = [], 1
        for out, kernel in self.conv:
            shapes.append((out, channels, kernel, kernel))
            channels = out
        return shapes

    def flat_features(self) -> int:
        """Inputs of the first fully connected layer: the pixels, or the last convolution's pooled maps."""
        if not self.conv:
            return self.in_features
        side = image_side(self.in_features)
        for _, kernel in self.conv:
            side = (side - kernel + 1) // 2
        return self.conv[-1][0] * side * side

    def layer_names(self) -> list[str]:
        """Names of the masked layers (convolutions, then linear layers), input to output."""
        if self.name is not None:
            return [name.removesuffix(".weight") for name in self._built_shapes()]
        names = [f"conv.{i}" for i in range(len(self.conv))]
        names += ["project"] if self.project_to is not None else []
        names += [f"hidden.{i}" for i in range(len(self.hidden))]
        return [*names, "output"]

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each layer's weight shape, keyed by layer name: (out, in, k, k) for a convolution, (out, in)
        for a linear layer."""
        if self.name is not None:
            return {name.removesuffix(".weight"): shape for name, shape in self._built_shapes().items()}
        convs: dict[str, tuple[int, ...]] = {f"conv.{i}": shape for i, shape in enumerate(self.conv_shapes())}
        return {**convs, **self.linear_shapes()}

    def _built_shapes(self) -> dict[str, tuple[int, ...]]:
        """The prunable weights' shapes of the network `build_network` makes (on the meta device)."""
        with torch.device("meta"):
            return {name: tuple(w.shape) for name, w in prunable_weights(build_network(self)).items()}

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear layer's weight, keyed by layer name."""
        widths = [self.flat_features()]
        if self.project_to is not None:
            widths.append(self.project_to)
        widths += [*self.hidden, self.num_classes]
        linear = [n for n in self.layer_names() if not n.startswith("conv.")]
        return {n: (widths[i + 1], widths[i]) for i, n in enumerate(linear)}


class LeNet(nn.Module):
    """The built-in network family as a plain `nn.Module`: LeNet-300-100 (Linear → activation → … →
    Linear, any widths) and LeNet-5 (a convolutional front, each convolution followed by the activation
    and 2×2 average pooling, then the fully connected layers).

    It holds no masks. A ticket's masks are data beside the model (`Masks`, keyed by mask name): they
    are installed by `apply_masks_`, which zeroes the pruned weights, and the training loops keep them
    zero (`PrunedWeights` after each update; DP steps never give a pruned coordinate a gradient or
    noise). The forward pass is the dense network's, so a ticket costs no reparametrisation (unlike
    `torch.nn.utils.prune`, which recomputes weight = weight_orig ⊙ mask on every call).

    The optional ``project`` layer (paper §4.5.2) maps a dataset's own input size onto the ticket's
    input size, so tickets transfer across domains; it is followed by no activation.
    """

    def __init__(self, arch: Architecture, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.arch = arch
        # parameter names are the layer names (conv.0.weight, project.weight, hidden.0.weight,
        # output.weight): a ticket's masks are keyed by them, as the DP engine keys any module's
        self.conv = nn.ModuleList(nn.Conv2d(channels, out, kernel) for out, channels, kernel, _ in arch.conv_shapes())
        linear = arch.linear_shapes()
        self.project = (nn.Linear(linear["project"][1], linear["project"][0]) if "project" in linear else None)
        self.hidden = nn.ModuleList(nn.Linear(linear[f"hidden.{i}"][1], linear[f"hidden.{i}"][0])
                                    for i in range(len(arch.hidden)))
        self.output = nn.Linear(linear["output"][1], linear["output"][0])
        self._conv_list = [(layer, f"conv.{i}") for i, layer in enumerate(self.conv)]
        self._layer_list: list[tuple[nn.Linear, str]] = (
            ([(self.project, "project")] if self.project is not None else [])
            + [(layer, f"hidden.{i}") for i, layer in enumerate(self.hidden)]  # type: ignore[misc]
            + [(self.output, "output")])
        self.reset_parameters(generator)
        self._side = image_side(arch.in_features) if arch.conv else 0
        self._has_projection = arch.project_to is not None
        self.activation = activation_function(arch.activation)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PyTorch's default Linear and Conv2d init (Kaiming-uniform), drawn from an explicit generator."""
        for layer, _ in (*self._conv_list, *self._layer_list):  # input to output, as the layers are named
            bound = 1.0 / (layer.weight[0].numel()) ** 0.5  # fan_in: in_features, or in_channels·k·k
            # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the weight.
            layer.weight.uniform_(-bound, bound, generator=generator)
            assert layer.bias is not None
            layer.bias.uniform_(-bound, bound, generator=generator)

    def mask_names(self) -> list[str]:
        """Names of the prunable weights (biases are never pruned), as masks are keyed."""
        return list(prunable_weights(self))

    def weights(self) -> dict[str, Tensor]:
        """The prunable weights, keyed by mask name."""
        return prunable_weights(self)

    def full_masks(self) -> Masks:
        """The dense network's masks: every weight kept."""
        return full_masks(self)

    def conv_layers_in_order(self) -> list[tuple[str, nn.Conv2d]]:
        """(mask name, convolution) of the convolutional front, input to output."""
        return [(f"{n}.weight", layer) for layer, n in self._conv_list]  # type: ignore[misc]

    def layers_in_order(self) -> list[tuple[str, nn.Linear]]:
        """(mask name, layer) of the linear layers from input to output: what per-sample norm code
        walks (after `conv_layers_in_order`)."""
        return [(f"{n}.weight", layer) for layer, n in self._layer_list]  # type: ignore[misc]

    def images(self, x: Tensor) -> Tensor:
        """Flat records as (B, 1, side, side) images, for the convolutional front."""
        return x.reshape(x.shape[0], 1, self._side, self._side)

    def after_conv(self, z: Tensor) -> Tensor:
        """What follows each convolution: the activation, then 2×2 average pooling."""
        return F.avg_pool2d(self.activation(z), 2)

    def forward(self, x: Tensor) -> Tensor:
        if self._conv_list:
            x = self.images(x)
            for layer, _ in self._conv_list:
                x = self.after_conv(layer(x))
            x = x.flatten(1)
        for i, (layer, _) in enumerate(self._layer_list):
            x = layer(x)
            if self.is_activation_after(i):
                x = self.activation(x)
        return x

    def is_activation_after(self, index: int) -> bool:
        """Whether the activation follows layer `index` (none after the projection or the output)."""
        return index != len(self._layer_list) - 1 and not (self._has_projection and index == 0)


def build_network(arch: Architecture, generator: torch.Generator | None = None) -> nn.Module:
    """The network `arch` describes, as a plain `nn.Module` with `arch` recorded on it: a LeNet for the
    built-in family, else the `build(arch, generator)` of the architecture's own module (one file under
    `dpltm/networks/` and its line in `dpltm/architectures.py`)."""
    if arch.name is None:
        return LeNet(arch, generator)
    module = ARCHITECTURES[arch.name].module
    assert module is not None
    network: nn.Module = importlib.import_module(module).build(arch, generator)
    network.arch = arch  # type: ignore[assignment]
    return network


def build_architecture(
    in_features: int, num_classes: int, hidden: Sequence[int], project_to: int | None,
    activation: str = "relu", arch: str = "mlp",
) -> Architecture:
    """The ticket's network for a dataset: input and class counts come from the data."""
    if arch not in ARCHS:
        raise DpltmUserError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    own_file = ARCHITECTURES[arch].module is not None
    return Architecture(int(in_features), tuple(int(h) for h in hidden), int(num_classes), project_to,
                        activation, ARCHS[arch], name=arch if own_file else None)
