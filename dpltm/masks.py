"""A ticket as data beside a plain `nn.Module`: a mask per prunable weight (`Masks`, keyed by mask name such as
``hidden.0.weight``).

Installing a ticket zeroes the pruned weights (`apply_masks_`); training keeps them exactly zero (`PrunedWeights`
after every update, and DP steps give pruned coordinates neither a clipped gradient nor noise). So a model file's
weights are the released network as it is, and the forward pass carries no mask multiply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from dpltm.errors import DpltmUserError


class LayerNames(Protocol):
    """What `split_stored_state` needs of an architecture (dpltm.networks.lenet.Architecture): its layers' names."""

    def layer_names(self) -> list[str]: ...

Masks = dict[str, Tensor]
"""Parameter name (e.g. ``hidden.0.weight``) -> bool tensor of the weight's shape."""


def pruned_but_not_zero(weights: dict[str, Tensor], masks: Masks) -> str | None:
    """The first weight that is non-zero where its mask prunes it, or None. A released network's pruned
    weights are zero (the forward pass does not mask: a non-zero pruned weight would act), so a file
    naming one is damaged."""
    for name, mask in masks.items():
        weight = weights.get(name)
        if weight is not None and weight.shape == mask.shape and bool((weight[~mask.bool()] != 0).any()):
            return name
    return None


def masked_weights(weights: dict[str, Tensor], masks: Masks) -> dict[str, Tensor]:
    """Copies of `weights` with each masked parameter zeroed where its mask prunes (the others as they are)."""
    return {k: v * masks[k].to(v.dtype) if k in masks else v.clone() for k, v in weights.items()}


def prunable_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights a ticket masks, keyed by parameter name (which is the mask's name): every trainable
    `weight` of two or more dimensions (linear, convolution and embedding matrices; never biases or
    normalisation scales). The one rule for the CLI's networks, the API and the DP engine."""
    return {name: p for name, p in model.named_parameters()
            if name.rpartition(".")[2] == "weight" and p.requires_grad and p.dim() >= 2}


def full_masks(model: nn.Module) -> Masks:
    """The dense network's masks: every prunable weight kept."""
    return {n: torch.ones(w.shape, dtype=torch.bool) for n, w in prunable_weights(model).items()}


def ticket_masks(masks: Mapping[str, Tensor]) -> Masks:
    """Stored masks (a ticket record's, a ticket set's next ones) as bool tensors."""
    return {k: v.to(torch.bool) for k, v in masks.items()}


def rewind(model: nn.Module, theta0: dict[str, Tensor], masks: Masks) -> Masks:
    """Rewind: every parameter back to θ0, then the mask, which zeroes the pruned weights; returns the
    installed masks (bool, on the model's device)."""
    missing, unexpected = model.load_state_dict(theta0, strict=False)
    if unexpected or missing:
        raise DpltmUserError("θ0 in the ticket file does not fit the architecture")
    return apply_masks_(model, masks)


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: Masks) -> Masks:
    """Install a ticket: check `masks` against the model (keys, shapes, 0/1), zero its pruned weights in
    place, and return the masks as bool tensors on the model's device (what the training loops keep)."""
    weights = prunable_weights(model)
    check_masks(masks, {n: tuple(w.shape) for n, w in weights.items()})
    installed = {}
    for name, mask in masks.items():
        weight = weights[name]
        installed[name] = mask.to(device=weight.device, dtype=torch.bool)
        weight.mul_(installed[name])
    return installed


def trained_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights as a ticket keeps them (θ0's keys, on the CPU, detached copies): a round's trained
    network (taken before pruning: zero exactly where its mask prunes), or late rewinding's θ_K."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def frozen_parameter_names(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """The parameters `freeze_layers_` would hold, or its one-line refusal (a name that is no layer of this
    network; every layer), without freezing anything: `dpltm run` checks --freeze before making tickets."""
    layers = list(dict.fromkeys(layers))
    if not layers:
        return []
    owners = {name.rpartition(".")[0]: None for name, _ in model.named_parameters()}
    unknown = [layer for layer in layers if layer not in owners]
    if unknown:
        raise DpltmUserError(f"--freeze names no layer of this network: {', '.join(unknown)} (its layers: "
                             f"{', '.join(owners)})")
    frozen = [name for name, _ in model.named_parameters() if name.rpartition(".")[0] in layers]
    if len(frozen) == len(list(model.parameters())):
        raise DpltmUserError("--freeze would hold every layer: nothing would be trained")
    return frozen


def freeze_layers_(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """Hold `layers` (layer names such as ``hidden.0`` or ``conv.1``) at the weights they have now: their
    parameters stop requiring gradients, so the DP step gives them no clipped gradient, no noise and no
    update (dpltm.dp.engine clips over the trainable parameters only), and they stay what the start made
    them — public-trained weights or θ0, both independent of the private data (Adamczewski & Park 2023,
    "parameter freezing"). Returns the frozen parameters' names. One-line refusals: a name that is no layer
    of this network, and freezing every layer (nothing left to train)."""
    frozen = frozen_parameter_names(model, layers)
    parameters = dict(model.named_parameters())
    for name in frozen:
        parameters[name].requires_grad_(False)
    return frozen


class PrunedWeights:
    """Keeps a ticket's pruned weights exactly zero through training: one in-place multiply per masked
    weight after each update (a fused `_foreach_mul_`), whatever the optimiser does (momentum, weight
    decay, a noisy update). Dense weights are skipped. Capturable in a CUDA graph (no host sync)."""

    def __init__(self, model: nn.Module, masks: Masks) -> None:
        weights = prunable_weights(model)  # a frozen layer is never updated: nothing to re-zero
        pairs = [(weights[n], m.to(device=weights[n].device, dtype=weights[n].dtype))
                 for n, m in masks.items() if n in weights and not bool(m.all())]
        self.weights = [w for w, _ in pairs]
        self.masks = [m for _, m in pairs]

    @torch.no_grad()
    def __call__(self) -> None:
        if self.weights:
            torch._foreach_mul_(self.weights, self.masks)


MASK_PREFIX = "mask_"
"""A model file or export keeps each mask beside the weights as ``mask_<name with _ for .>`` (bool)."""


def stored_mask_key(mask_name: str) -> str:
    """The key a mask is stored under beside the weights: hidden.0.weight → mask_hidden_0_weight."""
    return MASK_PREFIX + mask_name.replace(".", "_")


def stored_state(model: nn.Module, masks: Masks) -> dict[str, Tensor]:
    """What a model file and an export hold: the weights (pruned ones exactly 0) and, beside them, each
    mask as a bool tensor (`stored_mask_key`)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for name in dict.fromkeys([*prunable_weights(model), *masks]):  # frozen layers' masks too
        state[stored_mask_key(name)] = masks[name].detach().to("cpu", torch.bool)
    return state


def split_stored_state(arch: LayerNames, state: dict[str, Tensor]) -> tuple[dict[str, Tensor], Masks]:
    """`stored_state` taken apart: (the weights for `load_state_dict`, the masks keyed by mask name)."""
    keys = {stored_mask_key(f"{name}.weight"): f"{name}.weight" for name in arch.layer_names()}
    weights = {k: v for k, v in state.items() if k not in keys}
    masks = {keys[k]: v.to(torch.bool) for k, v in state.items() if k in keys}
    return weights, masks


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
