"""`TicketSet`: what a "tickets" checkpoint holds, the output of `dpltm generate` (IMP, phase 1).

θ0, one record per round (its mask, C, A and loss curve), the data they were made on, and a privacy
record: the DpEvent of phase 1 (`NonPrivateDpEvent`: IMP saw its data without privacy) and where it
ran. `TicketSet.to_dict()` is the checkpoint body, in the layout `dpltm.tickets.imp` has always
written; `TicketSet.from_dict(body, path)` checks every field and refuses a damaged file in one line
naming the file and the field. Readers ask the computed properties (C and A per ticket, the ε1 of
earlier draws, the phase-1 DpEvent) rather than picking through the dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.artefacts.fields import (
    HEADER_KEYS,
    check_header,
    check_unknown,
    damaged,
    mapping_of,
    number_list,
    typed,
)
from dpltm.checkpoint_format import FORMAT_VERSION

if TYPE_CHECKING:
    import torch

    from dpltm.privacy.events import DpEvent

KIND = "tickets"
TICKET_SET_KEYS = ("dpltm_version", "config", "config_hash", "architecture", "prune_rates", "seed", "data",
                   "theta0", "privacy", "tickets", "next_masks", "complete", "stop_reason", "wall_seconds",
                   "selection_draws")
"""The keys of a ticket set's body besides the header, in the order `dpltm generate` writes them."""
PHASE1_KEYS = ("phase1", "dp_event", "dataset", "split", "fingerprint", "note")


def _damaged(path: Path | str, what: str) -> Any:
    return damaged(path, KIND, what)


def _typed(record: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, path: Path | str,
           optional: bool = False) -> Any:
    return typed(record, key, types, where, path, KIND, optional)


def parse_event(record: Any, where: str, path: Path | str, kind: str) -> DpEvent:
    """A stored DpEvent (`privacy.events.event_to_json`), or a one-line refusal naming `where`."""
    from dpltm.errors import DpltmUserError
    from dpltm.privacy.events import event_from_json

    try:
        return event_from_json(record)
    except DpltmUserError as exc:
        raise damaged(path, kind, f"'{where}' is not a DpEvent ({exc})") from None
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise damaged(path, kind, f"'{where}' is not a DpEvent ({type(exc).__name__})") from None


@dataclass(frozen=True)
class Ticket:
    """One round of IMP: its mask, density C, validation accuracy A and training loss curve."""

    round: int
    masks: dict[str, torch.Tensor]
    density: float
    layer_density: dict[str, float]
    val_accuracy: float
    loss_curve: tuple[float, ...]
    loss_every: int | None = None
    """How many SGD steps apart the losses were logged."""
    next_density: float | None = None
    """C of the mask this round's pruning made (the next round's)."""
    controls: dict[str, Any] | None = None
    """The lottery-ticket controls (reinit, random mask), when generation ran them."""

    _KEYS = ("round", "masks", "density", "layer_density", "val_accuracy", "loss_curve", "loss_every",
             "next_density", "controls")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"round": self.round, "masks": self.masks, "density": self.density,
                               "layer_density": self.layer_density, "val_accuracy": self.val_accuracy,
                               "loss_curve": list(self.loss_curve)}
        for key in ("loss_every", "next_density", "controls"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, record: Any, index: int, path: Path | str) -> Ticket:
        """Ticket `index` of a set, its fields' types checked (its tensors are checked by the set)."""
        where = f"tickets[{index}]."
        if not isinstance(record, Mapping):
            raise _damaged(path, f"ticket {index} is not a record")
        check_unknown(record, cls._KEYS, f"'{where.rstrip('.')}'", path, KIND)
        round_ = _typed(record, "round", (int,), where, path)
        masks = _typed(record, "masks", (dict,), where, path)
        density = _typed(record, "density", (float,), where, path)
        layer_density = mapping_of(record, "layer_density", (float,), where, path, KIND)
        val_accuracy = _typed(record, "val_accuracy", (float,), where, path)
        loss_curve = number_list(record, "loss_curve", where, path, KIND)
        loss_every = _typed(record, "loss_every", (int,), where, path, optional=True)
        next_density = _typed(record, "next_density", (float,), where, path, optional=True)
        controls = _typed(record, "controls", (dict,), where, path, optional=True)
        return cls(round_, masks, density, layer_density, val_accuracy,  # type: ignore[arg-type]
                   tuple(loss_curve), loss_every, next_density, controls)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TicketSet:
    """A ticket set as `dpltm generate` writes it (and rewrites after every round, until `complete`).

    `privacy` is phase 1's record: its `dp_event` (what ran, as data), where it ran, and a note saying
    what that means for training on the same data. `selection_draws` is the ε1 of every
    exponential-mechanism draw already made from this set (written by `dpltm select`, so that each
    new winner's ledger composes them all).
    """

    architecture: dict[str, Any]
    theta0: dict[str, torch.Tensor]
    tickets: tuple[Ticket, ...]
    data: dict[str, Any]
    """The data the tickets were made on (`DatasetSplits.ticket_set_summary`), with its fingerprint."""
    config: dict[str, Any]
    privacy: dict[str, Any]
    seed: int
    complete: bool
    dpltm_version: str | None = None
    config_hash: str | None = None
    prune_rates: dict[str, float] | None = None
    next_masks: dict[str, torch.Tensor] | None = None
    """The mask the next round starts from (resuming an interrupted run)."""
    stop_reason: str | None = None
    wall_seconds: float | None = None
    selection_draws: tuple[float, ...] | None = None
    environment: dict[str, Any] | None = None
    """The library versions that wrote the file (set by `checkpoint.save_atomic`)."""

    # ---- computed facts -------------------------------------------------------------------

    @property
    def dataset(self) -> str:
        return str(self.data["dataset"])

    @property
    def split(self) -> str:
        return str(self.data["split"])

    @property
    def fingerprint(self) -> str:
        return str(self.data["fingerprint"])

    @property
    def densities(self) -> tuple[float, ...]:
        """C per ticket: the fraction of weights each mask keeps."""
        return tuple(float(t.density) for t in self.tickets)

    @property
    def accuracies(self) -> tuple[float, ...]:
        """A per ticket: the validation accuracy of each round."""
        return tuple(float(t.val_accuracy) for t in self.tickets)

    @property
    def draws(self) -> tuple[float, ...]:
        """ε1 of every exponential-mechanism draw already made from this set (none: empty)."""
        return tuple(float(e) for e in self.selection_draws or ())

    @property
    def phase1_event(self) -> DpEvent:
        """What generation did to its data, as a DpEvent (`NonPrivateDpEvent`)."""
        return parse_event(self.privacy["dp_event"], "privacy.dp_event", "ticket set", KIND)

    # ---- storage --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint body: header, then the fields in the order `dpltm generate` writes them."""
        body: dict[str, Any] = {
            "format": "dpltm", "kind": KIND, "format_version": FORMAT_VERSION,
            "dpltm_version": self.dpltm_version, "config": self.config, "config_hash": self.config_hash,
            "architecture": self.architecture, "prune_rates": self.prune_rates, "seed": self.seed,
            "data": self.data, "theta0": self.theta0, "privacy": self.privacy,
            "tickets": [t.to_dict() for t in self.tickets], "next_masks": self.next_masks,
            "complete": self.complete, "stop_reason": self.stop_reason, "wall_seconds": self.wall_seconds,
        }
        if self.environment is not None:  # where a rewrite keeps it: before the draws select appends
            body["environment"] = self.environment
        if self.selection_draws is not None:
            body["selection_draws"] = list(self.selection_draws)
        return body

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> TicketSet:
        """A ticket set from the dict `dpltm.tickets.imp` builds while it runs (with or without a header),
        checked as a file would be: a writer cannot save what a reader would refuse."""
        header = {"format": "dpltm", "kind": KIND, "format_version": FORMAT_VERSION}
        return cls.from_dict({**payload, **header}, "the ticket set being written")

    @classmethod
    def from_dict(cls, body: Any, path: Path | str) -> TicketSet:
        """A ticket set's body, checked: header and version, every field's type, an architecture that
        builds a network, θ0 and every mask fitting it, a phase-1 DpEvent that parses. One-line errors
        name the file and the field."""
        from dpltm.artefacts.networks import reference_masks, reference_theta0
        from dpltm.checkpoint_body import architecture_of, check_tensors

        body = check_header(body, KIND, path)
        data = _typed(body, "data", (dict,), "", path)
        for key in ("dataset", "split", "fingerprint"):
            _typed(data, key, (str,), "data.", path)
        architecture = _typed(body, "architecture", (dict,), "", path)
        theta0 = _typed(body, "theta0", (dict,), "", path)
        config = _typed(body, "config", (dict,), "", path)
        privacy = _typed(body, "privacy", (dict,), "", path)
        records = _typed(body, "tickets", (list,), "", path)
        complete = _typed(body, "complete", (bool,), "", path)
        seed = _typed(body, "seed", (int,), "", path)
        tickets = tuple(Ticket.from_dict(r, i, path) for i, r in enumerate(records))
        check_unknown(body, (*HEADER_KEYS, *TICKET_SET_KEYS), "", path, KIND)
        optional = {key: _typed(body, key, types, "", path, optional=True)
                    for key, types in (("dpltm_version", (str,)), ("config_hash", (str,)),
                                       ("next_masks", (dict,)), ("stop_reason", (str,)),
                                       ("wall_seconds", (float,)), ("environment", (dict,)))}
        prune_rates = mapping_of(body, "prune_rates", (float,), "", path, KIND, optional=True)
        draws = number_list(body, "selection_draws", "", path, KIND, optional=True)
        if draws is not None and not all(e > 0 for e in draws):
            raise _damaged(path, "'selection_draws' (ε1 of earlier draws) must be positive numbers")
        check_unknown(privacy, PHASE1_KEYS, "'privacy'", path, KIND)
        _typed(privacy, "phase1", (str,), "privacy.", path)
        parse_event(_typed(privacy, "dp_event", (dict,), "privacy.", path), "privacy.dp_event", path, KIND)
        for key in ("dataset", "split", "fingerprint", "note"):
            _typed(privacy, key, (str,), "privacy.", path, optional=True)
        arch = architecture_of(body, KIND, path)
        check_tensors(theta0, reference_theta0(arch), "theta0", KIND, path, check_dtype=True)
        masks = reference_masks(arch)
        for i, ticket in enumerate(tickets):
            check_tensors(ticket.masks, masks, f"tickets[{i}].masks", KIND, path, check_dtype=False)
        if optional["next_masks"] is not None:
            check_tensors(optional["next_masks"], masks, "next_masks", KIND, path, check_dtype=False)
        return cls(architecture=architecture, theta0=theta0, tickets=tickets, data=data, config=config,
                   privacy=privacy, seed=seed, complete=complete, prune_rates=prune_rates,
                   selection_draws=None if draws is None else tuple(draws), **optional)

