"""Build the network to train from a ticket, for the dataset at hand (paper §4.5).

* Same input size and classes: the ticket's θ0 and masks load as they are (KMNIST → MNIST).
* Otherwise (§4.5.2): the projection layer and the output layer are dropped, a fresh output
  layer for the new classes is added (dense, seeded init), and the hidden layers' masks and θ0
  carry over. The data's input size must then equal the first kept layer's input size: the
  ticket's projection width (`generate --project-to D`) or its original input size.

The activation is the training run's choice (`model.activation`), not necessarily the one the
ticket was found with: masks and θ0 carry over either way, and the transfer record says when
the two differ (so the dense baseline and the ticket train with the same network family).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dpltm.errors import DpltmUserError
from dpltm.model import Architecture, LeNet, Masks, apply_masks_, build_network


def model_from_ticket(ticket: dict[str, Any], num_features: int, num_classes: int,
                      seed: int, activation: str | None = None) -> tuple[torch.nn.Module, Masks, dict[str, Any]]:
    """The network to train at the ticket's start, its masks (installed), and how it relates to the
    ticket. `activation` (None: the ticket's own) replaces the activation the ticket was generated with."""
    ticket_arch = Architecture.from_dict(ticket["architecture"])
    arch = ticket_arch if activation is None else replace(ticket_arch, activation=activation)
    record = _activation_record(ticket_arch.activation, arch.activation)
    masks = {k: v.to(torch.bool) for k, v in ticket["masks"].items()}
    theta0 = ticket["theta0"]
    if arch.in_features == num_features and arch.num_classes == num_classes:
        model = build_network(arch, torch.Generator().manual_seed(seed))
        missing, unexpected = model.load_state_dict(theta0, strict=False)
        if unexpected or missing:
            raise DpltmUserError("the ticket's θ0 does not fit its architecture (damaged or foreign ticket)")
        return model, apply_masks_(model, masks), {"mode": "direct", "kept_layers": arch.layer_names(), **record}
    if not arch.is_mlp:
        raise DpltmUserError(f"a ticket of this network transfers only to data of its own shape ({arch.in_features} "
                             f"pixels, {arch.num_classes} classes); this data has {num_features} features and "
                             f"{num_classes} classes")
    first_in = arch.project_to if arch.project_to is not None else arch.in_features
    if num_features != first_in:
        hint = (f"generate tickets with --project-to {num_features}" if arch.project_to is None
                else f"its projection width is {arch.project_to}")
        raise DpltmUserError(
            f"the ticket's first hidden layer takes {first_in} inputs but the data has "
            f"{num_features} features ({hint})"
        )
    new_arch = Architecture(num_features, arch.hidden, num_classes, None, arch.activation)
    model = LeNet(new_arch, torch.Generator().manual_seed(seed))  # fresh output layer
    kept = [f"hidden.{i}" for i in range(len(arch.hidden))]
    with torch.no_grad():
        state = model.state_dict()
        for name in kept:
            for part in ("weight", "bias"):
                key = f"{name}.{part}"
                if key not in theta0 or theta0[key].shape != state[key].shape:
                    raise DpltmUserError(f"the ticket's θ0 lacks a usable {key} (damaged or foreign ticket)")
                state[key].copy_(theta0[key])
        model.load_state_dict(state)
    new_masks = model.full_masks()
    for name in kept:
        new_masks[f"{name}.weight"] = masks[f"{name}.weight"]
    installed = apply_masks_(model, new_masks)
    dropped = ["output"] + (["project"] if arch.project_to is not None else [])
    return model, installed, {"mode": "cross-architecture", "kept_layers": kept, "dropped_layers": dropped,
                   "new_output_classes": num_classes, **record}


def _activation_record(ticket_activation: str, used: str) -> dict[str, Any]:
    """The activation trained with, and the ticket's own when it was overridden."""
    if used == ticket_activation:
        return {"activation": used}
    return {"activation": used, "activation_override": {"ticket": ticket_activation, "used": used}}
