"""What a checkpoint's tensors must fit: the state an architecture builds, on PyTorch's `meta`
device (shapes only, no memory, no initialisation). One place for the artefacts to ask, so a change
of the network's layout is made here alone."""

from __future__ import annotations

from typing import Any


def reference_state(arch: Any) -> dict[str, Any]:
    """The network's whole state_dict (weights, biases and the boolean masks)."""
    import torch

    from dpltm.model import MaskedMLP

    with torch.device("meta"):
        return MaskedMLP(arch).state_dict()


def reference_theta0(arch: Any) -> dict[str, Any]:
    """θ0 as ticket files keep it: the network's parameters without its masks."""
    return {k: v for k, v in reference_state(arch).items() if not k.startswith("mask_")}


def reference_masks(arch: Any) -> dict[str, Any]:
    """A ticket's masks: one boolean tensor per prunable weight, keyed `<layer>.weight`."""
    import torch

    return {f"{name}.weight": torch.empty(shape, dtype=torch.bool, device="meta")
            for name, shape in arch.layer_shapes().items()}
