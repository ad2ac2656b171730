"""`Winner`: what a "ticket" checkpoint holds, the one ticket `dpltm train --ticket` trains.

Two writers make it: `dpltm select` (a winner drawn from a ticket set by a selection rule; its
`selection` record holds the rule, ε1, ν, Δ, the probability table and the rule's DpEvent) and
`dpltm generate --private` (a ticket made with privacy on the private data itself; its
`private_ticket` record holds the DP warm-up rounds and their composed DpEvent). Either way the file
holds θ0, the mask and its C, where it came from, and the events that touched data; readers ask the
computed properties (`dp_event`, `is_private_ticket`, `dataset`, …) rather than the dict. A winner
selected from a ticket set that kept its rounds' trained weights also holds the chosen round's
(`public_weights`), where `dpltm train --rewind public` starts; one selected from a set made with late
rewinding also holds θ_K under its mask (`rewind_point`), where `dpltm train --rewind K` starts.

`Winner.to_dict()` is the checkpoint body, in the layout both writers have always written;
`Winner.from_dict(body, path)` checks every field and refuses a damaged file in one line naming the
file and the field.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.artefacts.format import HEADER_KEYS, Artefact, Reader, body_of, reference_masks, reference_theta0
from dpltm.artefacts.ticket_set import Phase1Record, RewindPoint, check_phase1, phase1_view

if TYPE_CHECKING:
    import torch

    from dpltm.privacy.events import DpEvent

KIND = "ticket"
PRIVATE_METHOD = "private"
"""`selection.method` of a private ticket (`generate --private`): made, not selected."""
WINNER_KEYS = ("dpltm_version", "architecture", "theta0", "masks", "density", "layer_density", "round",
               "val_accuracy", "source", "privacy", "selection", "private_ticket", "public_weights",
               "rewind_point")
"""The keys of a winner's body besides the header, in the order the writers write them."""
PRIVATE_PRIVACY_KEYS = ("phase1",)
"""A private ticket's stored privacy record: phase 1's kind; its ε and statement are computed from the
warm-up's DpEvent (`Winner.epsilon_spent`, `Winner.statement`)."""
STORED_COPIES = ("end_to_end_dp", "epsilon_spent", "statement")
"""Copies of computed facts that private tickets written before stored beside `phase1`: read (checked
for type), never trusted: the computed ones are what every reader sees."""
SELECTION_TYPES: dict[str, tuple[type, ...]] = {
    "eps1": (float,), "draws": (int,), "eps1_total": (float,), "nu": (float,), "sensitivity": (float,),
    "near_uniform": (bool,), "randomness": (str,), "dp_event": (dict,), "noise_aware": (dict,)}
"""Types of the selection record's fields besides `method` (each may be absent or null; a rule may add
its own record beside them: `selection.winner.Selection.record`)."""
PRIVATE_TICKET_TYPES: dict[str, tuple[type, ...]] = {
    "warmup": (list,), "rounds": (list,), "rewind": (str,), "target_density": (float,), "noise": (str,),
    "noise_multiplier": (float,), "planned_training_steps": (int,), "epsilon_total": (float,),
    "delta": (float,), "accountant": (str,), "neighboring": (str,), "dp_event": (dict,), "randomness": (str,)}
_READ = Reader("winner", KIND)
"""Reads the DpEvents of a checked winner (its file was checked when it was read)."""



@dataclass(frozen=True)
class PrivateTicketRecord:
    """How a private ticket was made (`tickets.private.make_private_ticket`): its DP warm-up rounds (`warmup`: the
    q, σ and steps of each; `rounds`: what each did), their composed DpEvent, and the plan of the whole run whose
    δ, accountant and neighbouring relation its ε is stated under."""

    warmup: tuple[dict[str, Any], ...]
    rounds: tuple[dict[str, Any], ...]
    rewind: str
    target_density: float
    noise: str
    noise_multiplier: float
    planned_training_steps: int
    epsilon_total: float
    delta: float
    accountant: str
    neighboring: str
    dp_event: dict[str, Any]
    randomness: str

    def to_dict(self) -> dict[str, Any]:
        return body_of(self, PRIVATE_TICKET_TYPES)


@dataclass(frozen=True)
class Winner(Artefact):
    """A ticket ready to train: θ0, its mask, where it came from, and what touched data to make it."""

    KIND = KIND
    WHAT = "ticket"
    BODY = (*WINNER_KEYS, "environment")
    OMITTED_WHEN_NONE = ("private_ticket", "public_weights", "rewind_point", "environment")
    theta0: dict[str, torch.Tensor]
    masks: dict[str, torch.Tensor]
    density: float
    layer_density: dict[str, float]
    round: int
    val_accuracy: float
    source: dict[str, Any]
    """The ticket set's path (None for a private ticket), its data record and its config."""
    privacy: Phase1Record
    """Phase 1's record: the ticket set's (non-private IMP), or a private ticket's (DP warm-up)."""
    selection: dict[str, Any]
    private_ticket: PrivateTicketRecord | None = None
    """A private ticket's warm-up rounds, their DpEvent and the whole run's plan; None for a winner."""
    public_weights: dict[str, torch.Tensor] | None = None
    """The chosen ticket's weights at the end of its public training round (θ0's keys, zero where the mask
    prunes): `train --rewind public` starts from them. None for a private ticket and in older files."""
    rewind_point: RewindPoint | None = None
    """θ_K under the mask, where the set's rounds rewound to (late rewinding) and `train --rewind K` starts. None:
    rounds rewound to θ0."""

    # ---- computed facts -------------------------------------------------------------------

    @property
    def is_private_ticket(self) -> bool:
        """Made with privacy on the private data (`generate --private`), not selected from a set."""
        return self.selection_method == PRIVATE_METHOD

    @property
    def selection_method(self) -> str:
        return str(self.selection["method"])

    @property
    def source_data(self) -> dict[str, Any]:
        """The record of the data the ticket was made on."""
        return self.source["data"]  # type: ignore[no-any-return]

    @property
    def dataset(self) -> str:
        return str(self.source_data["dataset"])

    @property
    def rewind_step(self) -> int | None:
        """K of the iterate of public training the ticket holds (`rewind_point`), or None."""
        return None if self.rewind_point is None else self.rewind_point.step

    @property
    def selection_event(self) -> DpEvent | None:
        """The selection rule's DpEvent (None for a private ticket: it was not selected)."""
        record = self.selection.get("dp_event")
        return None if record is None else _READ.event(record, "selection.dp_event")

    @property
    def dp_event(self) -> DpEvent:
        """Everything that touched the ticket's data to make it, as one DpEvent tree: a private ticket's
        composed DP warm-up; a winner's phase 1 (non-private IMP) composed with its selection."""
        from dp_accounting import ComposedDpEvent  # type: ignore[import-untyped]

        if self.private_ticket is not None:
            return _READ.event(self.private_ticket.dp_event, "private_ticket.dp_event")
        phase1 = _READ.event(self.privacy.dp_event, "privacy.dp_event")
        selection = self.selection_event
        return phase1 if selection is None else ComposedDpEvent([phase1, selection])

    @functools.cached_property
    def epsilon_spent(self) -> float | None:
        """What a private ticket's DP warm-up spent: its composed DpEvent under the run's δ, accountant and
        neighbouring relation (docs/privacy.md §2); None for a winner, whose ε is the trained model's."""
        if self.private_ticket is None:
            return None
        from dpltm.privacy.accounting import epsilon

        record = self.private_ticket
        return epsilon(self.dp_event, float(record.delta), record.accountant, record.neighboring)

    @property
    def statement(self) -> str | None:
        """A private ticket's privacy statement (what `generate --private` prints), computed from its
        warm-up record; None for a winner, whose guarantee is stated by the model trained from it."""
        if self.private_ticket is None or self.epsilon_spent is None:
            return None
        from dpltm.privacy.display import format_delta, format_epsilon, format_rate, format_sigma

        record = self.private_ticket
        first = record.warmup[0]
        records = f"{int(first['dataset_size'])} " if "dataset_size" in first else ""
        return (f"made with privacy on {self.dataset}: {len(record.rounds)} DP-SGD warm-up round(s) of "
                f"{int(first['steps'])} steps, q = {format_rate(float(first['q']))}, σ = "
                f"{format_sigma(float(first['sigma']))}; "
                f"its weights and mask are (ε = {format_epsilon(self.epsilon_spent)}, "
                f"δ = {format_delta(float(record.delta))})-DP for the {records}training records (its validation "
                "accuracy is not private)")

    @property
    def privacy_view(self) -> dict[str, Any]:
        """The privacy record as `inspect` and `generate --private` show it: a private ticket's computed
        ε spent, statement and end-to-end flag beside its stored `phase1`; a selected winner's phase 1
        with where it ran."""
        if self.private_ticket is None:
            return phase1_view(self.privacy, self.source_data)
        return {"phase1": self.privacy.phase1, "end_to_end_dp": True, "epsilon_spent": self.epsilon_spent,
                "statement": self.statement}

    # ---- storage --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, body: Any, path: Path | str) -> Winner:
        """A winner's body, checked: header and version, every field's type, an architecture that builds
        a network, θ0 and the mask fitting it, its DpEvents parsing. One-line errors name the file and
        the field."""
        read = Reader(path, KIND)
        body = read.header(body)
        architecture = read.field(body, "architecture", (dict,))
        theta0 = read.field(body, "theta0", (dict,))
        masks = read.field(body, "masks", (dict,))
        density = read.field(body, "density", (float,))
        round_ = read.field(body, "round", (int,))
        layer_density = read.floats_by_name(body, "layer_density")
        source = read.field(body, "source", (dict,))
        source_data = read.field(source, "data", (dict,), "source.")
        for key in ("dataset", "split"):
            read.field(source_data, key, (str,), "source.data.")
        read.field(source, "tickets", (str,), "source.", optional=True)
        read.field(source, "config", (dict,), "source.", optional=True)
        selection = read.field(body, "selection", (dict,))
        method = read.field(selection, "method", (str,), "selection.")
        privacy = read.field(body, "privacy", (dict,))
        val_accuracy = read.field(body, "val_accuracy", (float,))
        read.unknown(body, (*HEADER_KEYS, *WINNER_KEYS))
        version_text = read.field(body, "dpltm_version", (str,), optional=True)
        environment = read.field(body, "environment", (dict,), optional=True)
        for key, types in SELECTION_TYPES.items():
            read.field(selection, key, types, "selection.", optional=True)
        for key in ("scores", "probabilities"):
            read.numbers(selection, key, "selection.", optional=True)
        if selection.get("dp_event") is not None:
            read.event(selection["dp_event"], "selection.dp_event")
        private_ticket = read.field(body, "private_ticket", (dict,), optional=method != PRIVATE_METHOD)
        public_weights = read.field(body, "public_weights", (dict,), optional=True)
        point = read.field(body, "rewind_point", (dict,), optional=True)
        for key, held in (("public_weights", public_weights), ("rewind_point", point)):
            if method == PRIVATE_METHOD and held is not None:
                raise read.damaged(f"a private ticket holds '{key}' (it was made on private data)")
        if method == PRIVATE_METHOD:
            _check_private(privacy, private_ticket, read)
            privacy = Phase1Record(privacy["phase1"])  # the copies of computed facts older files kept: dropped
            private_ticket = PrivateTicketRecord(**{k: tuple(v) if k in ("warmup", "rounds") else v
                                                    for k, v in private_ticket.items()})
        else:
            if private_ticket is not None:
                raise read.damaged(f"a winner selected by '{method}' holds a 'private_ticket' record")
            privacy = check_phase1(privacy, read)
        arch = read.architecture(architecture)
        read.tensors(theta0, reference_theta0(arch), "theta0", check_dtype=True)
        read.tensors(masks, reference_masks(arch), "masks", check_dtype=False)
        _check_copies(density, layer_density, masks, selection, read)  # type: ignore[arg-type]
        if public_weights is not None:
            read.trained(public_weights, masks, arch, "public_weights")
        rewind_point = None if point is None else RewindPoint.from_dict(point, reference_theta0(arch), read)
        if rewind_point is not None:
            read.trained(rewind_point.weights, masks, arch, "rewind_point.weights")
        return cls(architecture=architecture, theta0=theta0, masks=masks, density=density,
                   layer_density=layer_density, round=round_, val_accuracy=val_accuracy,  # type: ignore[arg-type]
                   source=source, privacy=privacy, selection=selection, private_ticket=private_ticket,
                   dpltm_version=version_text, environment=environment, public_weights=public_weights,
                   rewind_point=rewind_point)


def _check_private(privacy: Mapping[str, Any], record: Mapping[str, Any], read: Reader) -> None:
    """A private ticket's privacy record and its warm-up record (`tickets.private.make_private_ticket`)."""
    read.unknown(privacy, (*PRIVATE_PRIVACY_KEYS, *STORED_COPIES), "'privacy'")
    read.field(privacy, "phase1", (str,), "privacy.")
    for key, types in (("end_to_end_dp", (bool,)), ("epsilon_spent", (float,)), ("statement", (str,))):
        read.field(privacy, key, types, "privacy.", optional=True)
    read.unknown(record, PRIVATE_TICKET_TYPES, "'private_ticket'")
    for key, types in PRIVATE_TICKET_TYPES.items():
        read.field(record, key, types, "private_ticket.")
    warmup = record["warmup"]
    if not warmup or not all(isinstance(r, dict) for r in warmup):
        raise read.damaged("'private_ticket.warmup' must list the DP warm-up rounds' records")
    read.event(record["dp_event"], "private_ticket.dp_event")
    from dp_accounting import ComposedDpEvent  # type: ignore[import-untyped]

    from dpltm.privacy.accounting import ACCOUNTANTS, NEIGHBORING
    from dpltm.privacy.events import event_to_json
    from dpltm.privacy.ledger import dpsgd_events

    try:  # the event ε is computed from must be what training composes: one fact, not two
        composed = event_to_json(ComposedDpEvent(dpsgd_events(warmup)))
    except (KeyError, TypeError, ValueError):
        raise read.damaged("'private_ticket.warmup' records lack q, sigma or steps") from None
    if composed != record["dp_event"]:
        raise read.damaged("'private_ticket.dp_event' is not the composition of 'private_ticket.warmup'")

    for key, known in (("accountant", ACCOUNTANTS), ("neighboring", NEIGHBORING)):  # what ε is computed under
        if record[key] not in known:
            raise read.damaged(f"'private_ticket.{key}' is {record[key]!r}, not one of {', '.join(known)}")


def _check_copies(density: float, layer_density: Mapping[str, float], masks: Mapping[str, Any],
                  selection: Mapping[str, Any], read: Reader) -> None:
    """What a winner states beside its masks and its selection's DpEvent must agree with them: C is the
    masks' fraction of weights kept, and ε1 is the ε of the recorded exponential-mechanism event
    (ZCDp(ε1²/8)). A hand-edited ε1 once lowered the ε a run reported."""
    import math

    import torch
    from dp_accounting import ZCDpEvent  # type: ignore[import-untyped]

    kept = sum(int(torch.as_tensor(m).sum()) for m in masks.values())
    total = sum(torch.as_tensor(m).numel() for m in masks.values())
    if total and not math.isclose(density, kept / total, rel_tol=1e-9, abs_tol=1e-12):
        raise read.damaged(f"'density' {density:g} is not its masks' fraction of weights kept ({kept / total:g})")
    for name, value in layer_density.items():
        if name in masks and not math.isclose(value, float(torch.as_tensor(masks[name]).float().mean()),
                                              rel_tol=1e-6, abs_tol=1e-9):
            raise read.damaged(f"'layer_density.{name}' is not its mask's fraction of weights kept")
    eps1, total_eps1 = selection.get("eps1"), selection.get("eps1_total")
    if eps1 is None:
        return
    if not (math.isfinite(eps1) and eps1 > 0):
        raise read.damaged(f"'selection.eps1' must be a positive number, got {eps1}")
    if total_eps1 is not None and not total_eps1 >= eps1 * (1 - 1e-12):
        raise read.damaged("'selection.eps1_total' is below this draw's 'selection.eps1'")
    record = selection.get("dp_event")
    event = None if record is None else read.event(record, "selection.dp_event")
    if isinstance(event, ZCDpEvent) and not math.isclose(event.rho, eps1 * eps1 / 8.0, rel_tol=1e-9):
        raise read.damaged(f"'selection.eps1' {eps1:g} is not the ε1 of its recorded event (ρ = {event.rho:g})")
