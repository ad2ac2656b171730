"""Small, real artefacts for the checkpoint tests: a ticket set, a winner drawn from it and a private
ticket, each in the layout its writer (tickets.imp, selection.winner, tickets.private) uses."""

from __future__ import annotations

from typing import Any

import torch
from dp_accounting import ComposedDpEvent, NonPrivateDpEvent  # type: ignore[import-untyped]

from dpltm.artefacts import Phase1Record, PrivateTicketRecord, TicketRecord, TicketSet, Winner
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.privacy.events import dpsgd_event, event_to_json, selection_event
from dpltm.privacy.ledger import training_record

DATA = {"dataset": "kmnist", "split": "test", "n_train": 900, "fingerprint": "abc123",
        "fingerprint_note": "ticket set: kept for resuming and the overlap check"}


def _network() -> LeNet:
    return LeNet(build_architecture(64, 10, (16,), None), torch.Generator().manual_seed(0))


def _masks(keep: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {name: torch.rand(weight.shape, generator=gen) < keep for name, weight in _network().weights().items()}


def theta0() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _network().state_dict().items()}


def trained(masks: dict[str, torch.Tensor], shift: float) -> dict[str, torch.Tensor]:
    """Weights a round's training could end with: θ0 moved by `shift`, zero where `masks` prune."""
    return {k: (v + shift) * masks[k] if k in masks else v + shift for k, v in theta0().items()}


def ticket(round_: int, keep: float, accuracy: float) -> TicketRecord:
    masks = _masks(keep)
    kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    return TicketRecord(round=round_, masks=masks, density=kept,
                  layer_density={n: float(m.float().mean()) for n, m in masks.items()}, val_accuracy=accuracy,
                  loss_curve=(2.3, 1.1, 0.7), loss_every=10, next_density=kept * 0.8,
                  trained=trained(masks, 0.1 * (round_ + 1)))


def ticket_set(**changes: Any) -> TicketSet:
    fields: dict[str, Any] = dict(
        architecture=_network().arch.to_dict(), theta0=theta0(),
        tickets=(ticket(0, 1.01, 0.9), ticket(1, 0.5, 0.88), ticket(2, 0.25, 0.8)),
        data=dict(DATA), config={"seed": 0, "data": {"val_fraction": 0.1}}, seed=0, complete=True,
        privacy=Phase1Record("non-private", event_to_json(NonPrivateDpEvent())),
        dpltm_version="test", config_hash="0123456789abcdef", prune_rates={"hidden.0.weight": 0.2},
        next_masks=_masks(0.2), stop_reason="finished 2 pruning rounds", wall_seconds=1.5)
    fields.update(changes)
    return TicketSet(**fields)


def winner(eps1: float = 0.5) -> Winner:
    """The second ticket of `ticket_set()`, drawn by the exponential mechanism at `eps1`."""
    tickets = ticket_set()
    chosen = tickets.tickets[1]
    return Winner(
        architecture=tickets.architecture, theta0=tickets.theta0, masks=chosen.masks, density=chosen.density,
        layer_density=chosen.layer_density, round=chosen.round, val_accuracy=chosen.val_accuracy,
        source={"tickets": "t.pt", "data": tickets.data, "config": tickets.config}, privacy=tickets.privacy,
        selection={"method": "exponential", "eps1": eps1, "draws": 1, "eps1_total": eps1, "nu": 0.5,
                   "sensitivity": 0.5, "scores": [0.45, 0.66, 0.7], "probabilities": [0.3, 0.33, 0.37],
                   "near_uniform": True, "randomness": "OS CSPRNG",
                   "dp_event": event_to_json(selection_event(eps1)), "noise_aware": None},
        dpltm_version="test", public_weights=chosen.trained)


def private_ticket() -> Winner:
    """A ticket made with privacy on its own data (two DP warm-up rounds)."""
    warmup = ComposedDpEvent([dpsgd_event(0.01, 1.2, 100), dpsgd_event(0.01, 1.2, 100)])
    masks = _masks(0.3)
    round_record = training_record(0.01, 1.2, 100, 1.0, 10.0, 1000)
    return Winner(
        architecture=_network().arch.to_dict(), theta0=theta0(), masks=masks,
        density=sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values()),
        layer_density={n: float(m.float().mean()) for n, m in masks.items()}, round=2, val_accuracy=0.7,
        source={"tickets": None, "data": {"dataset": "digits", "split": "train", "n_train": 1000},
                "config": {"seed": 0, "train": {}, "data": {}}},
        privacy=Phase1Record("private"),
        selection={"method": "private", "eps1": None, "draws": 0, "eps1_total": None, "noise_aware": None},
        private_ticket=PrivateTicketRecord(
            warmup=(round_record, round_record), rounds=({"round": 1}, {"round": 2}), rewind="init",
            target_density=0.3, noise="gaussian", noise_multiplier=1.2, planned_training_steps=1000, epsilon_total=1.0,
            delta=1e-5, accountant="pld", neighboring="add_remove", dp_event=event_to_json(warmup),
            randomness="OS CSPRNG"),
        dpltm_version="test")
