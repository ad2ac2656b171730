"""`Winner`: a "ticket" checkpoint (a selected winner, or a private ticket) as a checked, frozen value.

Why these tests: `dpltm train --ticket` builds its privacy ledger from what this file says touched the
ticket's data (the selection rule's DpEvent, a private ticket's warm-up). A damaged record must be
refused in one line naming the file and the field when the file is loaded, not surface as a KeyError
mid-training or, worse, as a ledger missing a spend; and the artefact must keep the layout its two
writers have always written, so winners of the current format still load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_accounting import ComposedDpEvent, NonPrivateDpEvent  # type: ignore[import-untyped]

from dpltm.artefacts import Winner
from dpltm.artefacts.winner import WINNER_KEYS
from dpltm.checkpoint import load_checkpoint, load_winner, save_atomic
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import epsilon
from dpltm.privacy.display import format_epsilon
from dpltm.privacy.events import selection_event
from tests.core.bodies import private_ticket, ticket_set, winner


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("make", [winner, private_ticket], ids=["selected", "private"])
def test_round_trip_in_memory_and_through_a_file(tmp_path: Path, make: Any) -> None:
    original = make()
    assert _plain(Winner.from_dict(original.to_dict(), "memory").to_dict()) == _plain(original.to_dict())
    path = tmp_path / "w.pt"
    save_atomic(original.to_dict(), path, "ticket")
    loaded = load_winner(path)
    assert isinstance(loaded, Winner) and loaded.environment and loaded.environment["dpltm"]
    assert _plain(dataclasses.replace(original, environment=loaded.environment).to_dict()) == _plain(
        loaded.to_dict())


def test_the_layout_is_the_one_the_writers_write() -> None:
    """Keys and order of `selection.winner.make_winner` and `tickets.private.make_private_ticket`."""
    selected, made = winner().to_dict(), private_ticket().to_dict()
    assert list(selected) == ["format", "kind", "format_version", *WINNER_KEYS[:-3], "public_weights"]
    assert list(made) == ["format", "kind", "format_version", *WINNER_KEYS[:-2]]


def test_computed_facts() -> None:
    selected, made = winner(eps1=0.5), private_ticket()
    assert not selected.is_private_ticket and made.is_private_ticket
    assert selected.dataset == "kmnist" and made.dataset == "digits" and made.source["tickets"] is None
    assert selected.selection_event == selection_event(0.5) and made.selection_event is None
    assert selected.dp_event == ComposedDpEvent([NonPrivateDpEvent(), selection_event(0.5)])
    assert isinstance(made.dp_event, ComposedDpEvent) and len(made.dp_event.events) == 2
    spent = epsilon(made.dp_event, 1e-5, "pld", "add_remove")
    assert made.epsilon_spent == spent and selected.epsilon_spent is None and selected.statement is None
    assert made.statement == ("made with privacy on digits: 2 DP-SGD warm-up round(s) of 100 steps, q = 0.01, σ = 1.2; "
                              f"its weights and mask are (ε = {format_epsilon(spent)}, δ = 1e-05)-DP for the 1000 "
                              "training records (its validation accuracy is not private)")
    assert made.privacy_view == {"phase1": "private", "end_to_end_dp": True, "epsilon_spent": spent,
                                 "statement": made.statement}
    assert made.to_dict()["privacy"] == {"phase1": "private"}  # ε and the statement are never stored
    with pytest.raises(dataclasses.FrozenInstanceError):
        selected.round = 0  # type: ignore[misc]


def test_a_private_ticket_written_with_stored_copies_reads_its_computed_facts() -> None:
    """Private tickets written before kept ε spent and the statement beside the DpEvent: read, never trusted."""
    body = private_ticket().to_dict()
    body["privacy"].update(end_to_end_dp=True, epsilon_spent=0.001, statement="made with privacy: ε = 0.001")
    read = Winner.from_dict(body, "old.pt")
    assert read.privacy.to_dict() == {"phase1": "private"} and read.epsilon_spent == private_ticket().epsilon_spent
    assert read.privacy_view["statement"] == private_ticket().statement


def _refused(path: Path) -> str:
    with pytest.raises(DpltmUserError) as caught:
        load_checkpoint(path, "ticket")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    return message


SELECTED_DAMAGE = [
    (lambda b: b.pop("architecture"), "lacks 'architecture'"),
    (lambda b: b.pop("masks"), "lacks 'masks'"),
    (lambda b: b.__setitem__("density", "dense"), "'density' has the wrong type (str)"),
    (lambda b: b.__setitem__("round", 1.0), "'round' has the wrong type (float)"),
    (lambda b: b.__setitem__("layer_density", {"output.weight": None}), "'layer_density' must map names to"),
    (lambda b: b.pop("val_accuracy"), "lacks 'val_accuracy'"),
    (lambda b: b.pop("source"), "lacks 'source'"),
    (lambda b: b["source"].pop("data"), "lacks 'source.data'"),
    (lambda b: b["source"]["data"].pop("split"), "lacks 'source.data.split'"),
    (lambda b: b["source"].__setitem__("tickets", 3), "'source.tickets' has the wrong type (int)"),
    (lambda b: b.pop("selection"), "lacks 'selection'"),
    (lambda b: b["selection"].pop("method"), "lacks 'selection.method'"),
    (lambda b: b["selection"].__setitem__("eps1", "half"), "'selection.eps1' has the wrong type (str)"),
    (lambda b: b["selection"].__setitem__("draws", 1.5), "'selection.draws' has the wrong type (float)"),
    (lambda b: b["selection"].__setitem__("scores", ["high"]), "'selection.scores' must be a list of numbers"),
    (lambda b: b["selection"].__setitem__("dp_event", {"type": "Nope"}), "'selection.dp_event' is not a DpEvent"),
    # copies that must agree with what they copy (hand edits that changed the reported ε or C)
    (lambda b: b.__setitem__("density", 5.0), "'density' 5 is not its masks' fraction"),
    (lambda b: b["layer_density"].__setitem__("output.weight", 0.01), "'layer_density.output.weight' is not"),
    (lambda b: b["selection"].update(eps1=0.0001, eps1_total=0.0001), "'selection.eps1' 0.0001 is not the ε1"),
    (lambda b: b["selection"].__setitem__("eps1_total", 1e-9), "'selection.eps1_total' is below"),
    (lambda b: b["selection"].__setitem__("eps1", -1.0), "'selection.eps1' must be a positive number"),
    (lambda b: b["theta0"]["hidden.0.weight"].__setitem__((0, 0), float("nan")),
     "'theta0.hidden.0.weight' holds NaN or infinite values"),
    (lambda b: b.pop("privacy"), "lacks 'privacy'"),
    (lambda b: b["privacy"].pop("dp_event"), "lacks 'privacy.dp_event'"),
    (lambda b: b["privacy"].__setitem__("statement", "DP"), "'privacy' holds unknown ['statement']"),
    (lambda b: b.__setitem__("epsilon", 1.0), "it holds unknown ['epsilon']"),
    (lambda b: b.__setitem__("private_ticket", {}), "a winner selected by 'exponential' holds a 'private_ticket'"),
    (lambda b: b["masks"].pop("hidden.0.weight"), "'masks' does not fit its architecture"),
    (lambda b: b["theta0"].__setitem__("hidden.0.weight", torch.zeros(2, 2)),
     "'theta0.hidden.0.weight' has shape (2, 2)"),
    (lambda b: b.__setitem__("architecture", {"hidden": "wide"}), "'architecture' is invalid"),
    (lambda b: b.__setitem__("public_weights", []), "'public_weights' has the wrong type (list)"),
    (lambda b: b["public_weights"].pop("output.weight"), "'public_weights' does not fit its architecture"),
    (lambda b: b["public_weights"].__setitem__("hidden.0.bias", torch.zeros(2)),
     "'public_weights.hidden.0.bias' has shape (2,)"),
    (lambda b: b["public_weights"].__setitem__("output.weight", torch.ones(10, 16)),
     "'public_weights.output.weight' is non-zero where the mask prunes it"),
]
PRIVATE_DAMAGE = [
    (lambda b: b.__setitem__("public_weights", winner().public_weights),
     "a private ticket holds 'public_weights'"),
    (lambda b: b.__setitem__("rewind_point", {"step": 3, "weights": winner().public_weights}),
     "a private ticket holds 'rewind_point'"),
    (lambda b: b.pop("private_ticket"), "lacks 'private_ticket'"),
    (lambda b: b["private_ticket"].pop("warmup"), "lacks 'private_ticket.warmup'"),
    (lambda b: b["private_ticket"].__setitem__("warmup", []), "'private_ticket.warmup' must list the DP warm-up"),
    (lambda b: b["private_ticket"].__setitem__("epsilon_total", "one"), "'private_ticket.epsilon_total' has the"),
    (lambda b: b["private_ticket"].__setitem__("dp_event", {}), "'private_ticket.dp_event' is not a DpEvent"),
    (lambda b: b["private_ticket"].__setitem__("epsilon", 1), "'private_ticket' holds unknown ['epsilon']"),
    (lambda b: b["privacy"].pop("phase1"), "lacks 'privacy.phase1'"),
    (lambda b: b["private_ticket"].__setitem__("neighboring", "swap"), "'private_ticket.neighboring' is 'swap'"),
    (lambda b: b["private_ticket"]["warmup"][0].__setitem__("steps", 2000),
     "'private_ticket.dp_event' is not the composition of 'private_ticket.warmup'"),
    (lambda b: b["private_ticket"]["warmup"][0].pop("sigma"), "records lack q, sigma or steps"),
    (lambda b: b["privacy"].__setitem__("epsilon", 0.1), "'privacy' holds unknown ['epsilon']"),
    (lambda b: b["privacy"].__setitem__("end_to_end_dp", "yes"), "'privacy.end_to_end_dp' has the wrong type"),
]


@pytest.mark.parametrize(("make", "edit", "fragment"),
                         [(winner, *d) for d in SELECTED_DAMAGE] + [(private_ticket, *d) for d in PRIVATE_DAMAGE],
                         ids=[d[1] for d in SELECTED_DAMAGE] + [f"private: {d[1]}" for d in PRIVATE_DAMAGE])
def test_a_damaged_file_is_refused_in_one_line(tmp_path: Path, make: Any, edit: Any, fragment: str) -> None:
    path = tmp_path / "w.pt"
    body = make().to_dict()
    edit(body)
    torch.save(body, path)
    message = _refused(path)
    assert "is a damaged 'ticket' checkpoint" in message and fragment in message, message


def test_a_winner_written_before_public_weights_still_loads() -> None:
    """Winners selected before the rounds' trained weights were kept have none: they load (and train from
    θ0; `train --rewind public` refuses them)."""
    body = winner().to_dict()
    del body["public_weights"]
    assert Winner.from_dict(body, "old.pt").public_weights is None


def test_a_ticket_set_is_no_winner(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    save_atomic(ticket_set().to_dict(), path, "tickets")
    with pytest.raises(DpltmUserError, match=r"is a ticket set: pick a winner with `dpltm select --tickets"):
        load_winner(path)


def test_a_writer_cannot_save_what_a_reader_would_refuse() -> None:
    payload = {k: v for k, v in winner().to_dict().items() if k not in ("format", "kind", "format_version")}
    assert Winner.from_payload(payload).round == 1
    with pytest.raises(DpltmUserError, match="the ticket being written is a damaged 'ticket' checkpoint"):
        Winner.from_payload({**payload, "round": "first"})
