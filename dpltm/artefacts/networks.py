"""What a checkpoint's tensors must fit: the state an architecture builds, on PyTorch's `meta`
device (shapes only, no memory, no initialisation). One place for the artefacts to ask, so a change
of the network's layout is made here alone."""

from __future__ import annotations

from typing import Any


def reference_state(arch: Any) -> dict[str, Any]:
    """A model file's state (`dpltm.masks.stored_state`): weights, biases and, beside them, the boolean
    masks."""

    from dpltm.masks import stored_mask_key

    masks = {stored_mask_key(name): mask for name, mask in reference_masks(arch).items()}
    return {**reference_theta0(arch), **masks}


def reference_theta0(arch: Any) -> dict[str, Any]:
    """θ0 as ticket files keep it: the network's parameters (the model holds no masks)."""
    import torch

    from dpltm.networks.lenet import build_network

    with torch.device("meta"):
        return build_network(arch).state_dict()


def reference_masks(arch: Any) -> dict[str, Any]:
    """A ticket's masks: one boolean tensor per prunable weight, keyed `<layer>.weight`."""
    import torch

    return {f"{name}.weight": torch.empty(shape, dtype=torch.bool, device="meta")
            for name, shape in arch.layer_shapes().items()}
