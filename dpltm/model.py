"""The paper's fully connected network (ReLU, or a bounded activation) with one binary mask per
weight matrix.

Masks are buffers, so they move with the model and live in its state_dict. The forward pass
multiplies each weight by its mask, which makes pruned weights exactly zero in every forward
pass and gives them exactly zero gradient, whatever the optimiser or noise does to the raw
parameter (DP noise on a pruned coordinate is discarded by the mask: post-processing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.errors import DpltmUserError

Masks = dict[str, Tensor]
"""Parameter name (e.g. ``hidden.0.weight``) -> bool tensor of the weight's shape."""

#: The largest network dpltm builds. 10⁸ parameters are 400 MB of float32 weights, before the
#: masks, the optimiser state and the θ0 and mask copies a ticket file keeps (the paper's
#: LeNet-300-100 has 266 610); `--hidden 100000,100000` would ask for 40 GB.
MAX_PARAMETERS = 10**8

#: The hidden layers' activation, by name. ReLU is the paper's; tanh is bounded, which helps under
#: DP (Papernot et al. 2021, "Tempered sigmoid activations for deep learning with differential
#: privacy": clipping loses less when activations cannot explode).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "tanh": torch.tanh}


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


@dataclass(frozen=True)
class Architecture:
    """Everything needed to rebuild the network; stored in every checkpoint."""

    in_features: int
    hidden: tuple[int, ...]
    num_classes: int
    project_to: int | None = None
    activation: str = "relu"
    """Hidden layers' activation (a key of ACTIVATIONS); files written before it existed: relu."""

    def __post_init__(self) -> None:
        activation_function(self.activation)
        sizes = [self.in_features, *self.hidden, self.num_classes]
        if self.project_to is not None:
            sizes.append(self.project_to)
        if any(int(s) <= 0 for s in sizes):
            raise DpltmUserError(f"layer sizes must be positive, got {sizes}")
        check_network_size(self.in_features, self.hidden, self.num_classes, self.project_to)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Architecture:
        project_to = d.get("project_to")
        return cls(
            in_features=int(d["in_features"]),  # type: ignore[call-overload]
            hidden=tuple(int(h) for h in d["hidden"]),  # type: ignore[union-attr]
            num_classes=int(d["num_classes"]),  # type: ignore[call-overload]
            project_to=None if project_to is None else int(project_to),  # type: ignore[call-overload]
            activation=str(d.get("activation", "relu")),
        )

    def layer_names(self) -> list[str]:
        """Names of the linear layers, input to output."""
        names = ["project"] if self.project_to is not None else []
        names += [f"hidden.{i}" for i in range(len(self.hidden))]
        return [*names, "output"]

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each layer's weight, keyed by layer name."""
        widths = [self.in_features]
        if self.project_to is not None:
            widths.append(self.project_to)
        widths += [*self.hidden, self.num_classes]
        return {n: (widths[i + 1], widths[i]) for i, n in enumerate(self.layer_names())}


class MaskedMLP(nn.Module):
    """Linear → activation → … → Linear, each weight multiplied by its mask (ReLU unless the
    architecture names another activation).

    The optional ``project`` layer (paper §4.5.2) maps a dataset's own input size onto the
    ticket's input size, so tickets transfer across domains; it is followed by no activation.
    """

    def __init__(self, arch: Architecture, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleDict()
        for name, (fan_out, fan_in) in arch.layer_shapes().items():
            self.layers[name.replace(".", "_")] = nn.Linear(fan_in, fan_out)
        self.reset_parameters(generator)
        for name in self.mask_names():
            self.register_buffer(_buffer_name(name), torch.ones_like(self._weight(name), dtype=torch.bool))
            # The same mask in the weights' dtype, for the forward pass: multiplying by a bool
            # mask converts it to float on every call. Derived state, so not saved.
            self.register_buffer(_float_buffer_name(name), torch.ones_like(self._weight(name)), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_float_masks())
        self._layer_list = [(self.layers[n.replace(".", "_")], n) for n in arch.layer_names()]
        self._has_projection = arch.project_to is not None
        self.activation = activation_function(arch.activation)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PyTorch's default Linear init (Kaiming-uniform), drawn from an explicit generator."""
        for layer in self.layers.values():
            assert isinstance(layer, nn.Linear)
            bound = 1.0 / layer.in_features**0.5
            # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the weight.
            layer.weight.uniform_(-bound, bound, generator=generator)
            assert layer.bias is not None
            layer.bias.uniform_(-bound, bound, generator=generator)

    def mask_names(self) -> list[str]:
        """Parameter names of the prunable weights (biases are never pruned)."""
        return [f"{n}.weight" for n in self.arch.layer_names()]

    def _weight(self, name: str) -> Tensor:
        layer = self.layers[name.rsplit(".", 1)[0].replace(".", "_")]
        assert isinstance(layer, nn.Linear)
        return layer.weight

    def weights(self) -> dict[str, Tensor]:
        """The raw prunable weights, keyed by mask name."""
        return {n: self._weight(n) for n in self.mask_names()}

    def masks(self) -> Masks:
        return {n: getattr(self, _buffer_name(n)) for n in self.mask_names()}

    @torch.no_grad()
    def set_masks(self, masks: Masks) -> None:
        """Install masks (checked: same keys, shapes, 0/1 only) and zero the pruned weights."""
        check_masks(masks, {n: tuple(w.shape) for n, w in self.weights().items()})
        for name, mask in masks.items():
            buf = getattr(self, _buffer_name(name))
            buf.copy_(mask.to(device=buf.device, dtype=torch.bool))
            self._weight(name).mul_(buf)
        self._refresh_float_masks()

    @torch.no_grad()
    def _refresh_float_masks(self) -> None:
        for name in self.mask_names():
            getattr(self, _float_buffer_name(name)).copy_(getattr(self, _buffer_name(name)))

    def forward_masks(self) -> list[Tensor]:
        """The masks in the weights' dtype, input to output (what the forward pass multiplies by)."""
        return [getattr(self, _float_buffer_name(f"{n}.weight")) for _, n in self._layer_list]

    def forward(self, x: Tensor) -> Tensor:
        last = len(self._layer_list) - 1
        for i, (layer, name) in enumerate(self._layer_list):
            mask = getattr(self, _float_buffer_name(f"{name}.weight"))
            x = F.linear(x, layer.weight * mask, layer.bias)
            if i != last and not (self._has_projection and i == 0):
                x = self.activation(x)
        return x

    def layers_in_order(self) -> list[tuple[str, nn.Linear, Tensor]]:
        """(mask name, layer, mask) from input to output: what per-sample norm code walks."""
        return [
            (f"{n}.weight", layer, getattr(self, _buffer_name(f"{n}.weight")))
            for layer, n in self._layer_list
        ]

    def is_activation_after(self, index: int) -> bool:
        """Whether the activation follows layer `index` (none after the projection or the output)."""
        return index != len(self._layer_list) - 1 and not (self._has_projection and index == 0)


def _buffer_name(mask_name: str) -> str:
    return "mask_" + mask_name.replace(".", "_")


def _float_buffer_name(mask_name: str) -> str:
    return "fmask_" + mask_name.replace(".", "_")


def check_masks(masks: Masks, shapes: dict[str, tuple[int, ...]]) -> None:
    """A mask set is a checked value: exactly the expected keys, shapes and 0/1 entries."""
    missing = sorted(set(shapes) - set(masks))
    extra = sorted(set(masks) - set(shapes))
    if missing or extra:
        raise DpltmUserError(f"mask keys do not match the model: missing {missing}, unexpected {extra}")
    for name, mask in masks.items():
        if tuple(mask.shape) != tuple(shapes[name]):
            raise DpltmUserError(
                f"mask {name} has shape {tuple(mask.shape)}, the model needs {tuple(shapes[name])}"
            )
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
            raise DpltmUserError(f"mask {name} holds values other than 0 and 1")


def density(masks: Masks) -> float:
    """C: the fraction of prunable weights left."""
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    return kept / total


def layer_densities(masks: Masks) -> dict[str, float]:
    return {n: int(m.sum()) / m.numel() for n, m in masks.items()}


def build_architecture(
    in_features: int, num_classes: int, hidden: Sequence[int], project_to: int | None,
    activation: str = "relu",
) -> Architecture:
    """The ticket's network for a dataset: input and class counts come from the data."""
    return Architecture(int(in_features), tuple(int(h) for h in hidden), int(num_classes), project_to,
                        activation)
