"""Build the network to train from a ticket, for the dataset at hand (paper §4.5).

* Same input size and classes: the ticket's θ0 and masks load as they are (KMNIST → MNIST).
* Otherwise (§4.5.2): the projection layer and the output layer are dropped, a fresh output
  layer for the new classes is added (dense, seeded init), and the hidden layers' masks and θ0
  carry over. The data's input size must then equal the first kept layer's input size: the
  ticket's projection width (`generate --project-to D`) or its original input size.

The activation is the training run's choice (`model.activation`), not necessarily the one the
ticket was found with: masks and θ0 carry over either way, and the transfer record says when
the two differ (so the dense baseline and the ticket train with the same network family).

Where the weights start (`start`, `train --rewind`): θ0 (`init`, the paper's), or the weights the
ticket's public IMP round ended with (`public`, the winner's `public_weights`), so the public
training is not thrown away, or (`K`, a step number) θ_K, the dense network's weights K steps into public
training, where a late-rewound ticket set's rounds started (the winner's `rewind_point`; Frankle et al. 2020).
Both public starts' output layer was trained for the public data's classes, which are not the private
data's even when their number agrees (KMNIST's ten characters are not MNIST's digits):
`output_layer="reinit"` (the default) takes θ0's output layer and the rest public, `keep` keeps the public
one (refused when the class count differs). A cross-architecture
transfer builds a new output layer either way. The masks are applied after loading, so pruned
weights are exactly zero whichever start. The transfer record says which start was used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dpltm.artefacts.trained_model import TransferRecord
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import Architecture, LeNet, build_network
from dpltm.settings import OUTPUT_LAYERS, late_rewind_step

if TYPE_CHECKING:
    from dpltm.artefacts import RewindPoint, Winner


def start_weights(theta0: dict[str, torch.Tensor], public: dict[str, torch.Tensor] | None,
                  point: RewindPoint | None, arch: Architecture, start: str, output_layer: str,
                  num_classes: int) -> dict[str, torch.Tensor]:
    """The weights training starts from: θ0 (`init`), or a ticket's public-trained weights (`public`) or the
    iterate K of public training its `point` holds (`K`), each with θ0's output layer (`reinit`) or their own
    (`keep`, only for as many classes as the ticket's `arch`)."""
    step = late_rewind_step(start)
    if output_layer not in OUTPUT_LAYERS:
        raise DpltmUserError(f"--output-layer must be one of {', '.join(OUTPUT_LAYERS)}, got {output_layer!r}")
    if start == "init":  # every layer θ0's (`pipeline.check_start` refuses `keep` here for a run)
        return theta0
    if step is not None:
        public = rewound_weights(point, step)
    if public is None:
        raise DpltmUserError("--rewind public: this ticket holds no public-trained weights (a winner selected from "
                             "a ticket set written before they were kept): generate and select again, or train "
                             "with --rewind init")
    if output_layer == "keep":
        if arch.num_classes != num_classes:
            raise DpltmUserError(f"--output-layer keep: the ticket's output layer was trained for {arch.num_classes} "
                                 f"classes, this data has {num_classes}; use --output-layer reinit")
        return dict(public)
    output = f"{arch.layer_names()[-1]}."
    return {k: theta0[k] if k.startswith(output) else v for k, v in public.items()}


def rewound_weights(point: RewindPoint | None, step: int) -> dict[str, torch.Tensor]:
    """θ_K, a ticket's iterate `step` of public training (late rewinding: its `point`), or a one-line refusal
    naming what the ticket holds."""
    if point is None:
        raise DpltmUserError(f"--rewind {step}: this ticket holds no iterate of public training (its tickets "
                             "rewound to θ0); make them with generate --rewind-step K, or train with --rewind init "
                             "or public")
    if point.step != step:
        raise DpltmUserError(f"--rewind {step}: this ticket holds iterate {point.step} of public training "
                             f"(generate --rewind-step {point.step}); use --rewind {point.step}, init or public")
    return point.weights


def model_from_ticket(ticket: Winner, num_features: int, num_classes: int,
                      seed: int, activation: str | None = None, start: str = "init",
                      output_layer: str = "reinit") -> tuple[torch.nn.Module, Masks, TransferRecord]:
    """The network to train at the ticket's start, its masks (installed), and how it relates to the
    ticket. `activation` (None: the ticket's own) replaces the activation the ticket was generated with;
    `start` and `output_layer` choose the weights (`start_weights`)."""
    ticket_arch = Architecture.from_dict(ticket.architecture)
    arch = ticket_arch if activation is None else replace(ticket_arch, activation=activation)
    override = (None if arch.activation == ticket_arch.activation
                else {"ticket": ticket_arch.activation, "used": arch.activation})
    record = TransferRecord("direct", activation=arch.activation, activation_override=override, rewind=start,
                            output_layer=None if start == "init" else output_layer)
    masks = {k: v.to(torch.bool) for k, v in ticket.masks.items()}
    weights = start_weights(ticket.theta0, ticket.public_weights, ticket.rewind_point, ticket_arch, start,
                            output_layer, num_classes)
    if arch.in_features == num_features and arch.num_classes == num_classes:
        model = build_network(arch, torch.Generator().manual_seed(seed))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or missing:
            raise DpltmUserError("the ticket's start weights do not fit its architecture (damaged or foreign ticket)")
        return model, apply_masks_(model, masks), replace(record, kept_layers=arch.layer_names())
    if not arch.is_mlp:
        raise DpltmUserError(f"a ticket of this network transfers only to data of its own shape ({arch.in_features} "
                             f"pixels, {arch.num_classes} classes); this data has {num_features} features and "
                             f"{num_classes} classes")
    if output_layer == "keep" and start != "init":
        raise DpltmUserError("--output-layer keep: a cross-architecture transfer builds a new output layer (the data's "
                             "input size differs from the ticket's); use --output-layer reinit")
    first_in = arch.project_to if arch.project_to is not None else arch.in_features
    if num_features != first_in:
        if ticket.is_private_ticket:
            raise DpltmUserError(f"this private ticket was made on {ticket.dataset} ({first_in} features) and this "
                                 f"data has {num_features}: train it on the data it was made on, or make one on this "
                                 "data with `dpltm generate --private --dataset …`")
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
                if key not in weights or weights[key].shape != state[key].shape:
                    raise DpltmUserError(f"the ticket's start weights lack a usable {key} (damaged or foreign ticket)")
                state[key].copy_(weights[key])
        model.load_state_dict(state)
    new_masks = model.full_masks()
    for name in kept:
        new_masks[f"{name}.weight"] = masks[f"{name}.weight"]
    installed = apply_masks_(model, new_masks)
    dropped = ["output"] + (["project"] if arch.project_to is not None else [])
    return model, installed, replace(record, mode="cross-architecture", kept_layers=kept, dropped_layers=dropped,
                                     new_output_classes=num_classes)
