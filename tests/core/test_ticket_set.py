"""`TicketSet`: a "tickets" checkpoint as a checked, frozen value.

Why these tests: every stage that reads a ticket set (select, inspect, train, a resumed generate) now
reads it through `TicketSet.from_dict`, so the artefact must lose nothing on the way to a file and
back, keep the layout `dpltm generate` has always written (old files of the current format still
load), and refuse a damaged file in one line naming the file and the field, before any stage uses it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_accounting import NonPrivateDpEvent  # type: ignore[import-untyped]

from dpltm.artefacts import TicketSet
from dpltm.artefacts.ticket_set import TICKET_SET_KEYS
from dpltm.checkpoint import load_checkpoint, load_ticket_set, save_atomic
from dpltm.errors import DpltmUserError
from dpltm.privacy.events import event_from_json
from tests.core.bodies import ticket_set, winner


def _same(a: TicketSet, b: TicketSet) -> None:
    def plain(value: Any) -> Any:  # tensors compared by value, everything else by ==
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.tolist())
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    assert plain(a.to_dict()) == plain(b.to_dict())


def test_round_trip_in_memory_and_through_a_file(tmp_path: Path) -> None:
    original = ticket_set(selection_draws=(0.5, 0.25))
    _same(original, TicketSet.from_dict(original.to_dict(), "memory"))
    path = tmp_path / "t.pt"
    save_atomic(original.to_dict(), path, "tickets")
    loaded = load_ticket_set(path)
    assert isinstance(loaded, TicketSet) and loaded.environment and loaded.environment["dpltm"]
    _same(dataclasses.replace(original, environment=loaded.environment), loaded)


def test_the_layout_is_the_one_generate_writes() -> None:
    """Same keys, same order as `tickets.imp._new_payload` (after the header); the draws select records
    come after the environment, where re-saving the loaded dict put them."""
    body = ticket_set(selection_draws=(0.5,), environment={"dpltm": "x"}).to_dict()
    assert list(body)[:3] == ["format", "kind", "format_version"]
    assert list(body)[3:] == [*TICKET_SET_KEYS[:-1], "environment", "selection_draws"]
    assert set(ticket_set().to_dict()) == {"format", "kind", "format_version", *TICKET_SET_KEYS} - {"selection_draws"}
    assert list(body["tickets"][0]) == ["round", "masks", "density", "layer_density", "val_accuracy", "loss_curve",
                                        "loss_every", "next_density", "trained"]


def test_a_file_of_the_current_layout_without_optional_keys_still_loads() -> None:
    """Older files of the same format lack nothing a reader needs; optional keys read as None."""
    body = ticket_set().to_dict()
    for key in ("dpltm_version", "config_hash", "prune_rates", "next_masks", "stop_reason", "wall_seconds"):
        del body[key]
    for record in body["tickets"]:
        del record["loss_every"], record["next_density"], record["trained"]
    loaded = TicketSet.from_dict(body, "old.pt")
    assert loaded.config_hash is None and loaded.tickets[0].next_density is None and loaded.draws == ()
    assert loaded.tickets[0].trained is None  # sets written before the rounds' weights were kept


def test_computed_facts() -> None:
    tickets = ticket_set(selection_draws=(0.5, 0.25))
    assert tickets.tickets[0].density == 1.0
    assert tickets.accuracies == (0.9, 0.88, 0.8)
    assert tickets.draws == (0.5, 0.25) and tickets.dataset == "kmnist" and tickets.split == "test"
    assert event_from_json(tickets.privacy.dp_event) == NonPrivateDpEvent()
    with pytest.raises(dataclasses.FrozenInstanceError):
        tickets.complete = False  # type: ignore[misc]


def test_a_writer_cannot_save_what_a_reader_would_refuse() -> None:
    payload = ticket_set().to_dict()
    for key in ("format", "kind", "format_version"):
        del payload[key]
    assert TicketSet.from_payload(payload).to_dict()["kind"] == "tickets"
    with pytest.raises(DpltmUserError, match="the ticket set being written is a damaged 'tickets' checkpoint"):
        TicketSet.from_payload({**payload, "complete": "yes"})


def _refused(path: Path) -> str:
    with pytest.raises(DpltmUserError) as caught:
        load_checkpoint(path, "tickets")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    return message


DAMAGE = [
    (lambda b: b.pop("data"), "lacks 'data'"),
    (lambda b: b.__setitem__("tickets", []), "it holds no tickets"),
    (lambda b: b["data"].pop("fingerprint"), "lacks 'data.fingerprint'"),
    (lambda b: b["data"].__setitem__("dataset", 3), "'data.dataset' has the wrong type (int)"),
    (lambda b: b.pop("theta0"), "lacks 'theta0'"),
    (lambda b: b.__setitem__("config", []), "'config' has the wrong type (list)"),
    (lambda b: b.pop("privacy"), "lacks 'privacy'"),
    (lambda b: b.__setitem__("tickets", {}), "'tickets' has the wrong type (dict)"),
    (lambda b: b.__setitem__("complete", "yes"), "'complete' has the wrong type (str)"),
    (lambda b: b.__setitem__("seed", 1.5), "'seed' has the wrong type (float)"),
    (lambda b: b.__setitem__("seed", True), "'seed' has the wrong type (bool)"),
    (lambda b: b.__setitem__("config_hash", 7), "'config_hash' has the wrong type (int)"),
    (lambda b: b.__setitem__("wall_seconds", "long"), "'wall_seconds' has the wrong type (str)"),
    (lambda b: b.__setitem__("prune_rates", {"hidden.0.weight": "a lot"}), "'prune_rates' must map names to"),
    (lambda b: b.__setitem__("selection_draws", [0.5, -1]), "'selection_draws' (ε1 of earlier draws) must be"),
    (lambda b: b.__setitem__("selection_draws", ["0.5"]), "'selection_draws' must be a list of numbers"),
    (lambda b: b.__setitem__("epsilon", 0.1), "it holds unknown ['epsilon']"),
    (lambda b: b["tickets"].__setitem__(1, "round 1"), "ticket 1 is not a record"),
    (lambda b: b["tickets"][1].pop("masks"), "lacks 'tickets[1].masks'"),
    (lambda b: b["tickets"][1].pop("val_accuracy"), "lacks 'tickets[1].val_accuracy'"),
    (lambda b: b["tickets"][1].__setitem__("density", "half"), "'tickets[1].density' has the wrong type"),
    (lambda b: b["tickets"][1].__setitem__("loss_curve", [1.0, None]), "'tickets[1].loss_curve' must be a list"),
    (lambda b: b["tickets"][1].__setitem__("layer_density", []), "'tickets[1].layer_density' has the wrong type"),
    (lambda b: b["tickets"][1].__setitem__("statement", "DP"), "'tickets[1]' holds unknown ['statement']"),
    (lambda b: b["tickets"][1]["masks"].pop("output.weight"), "'tickets[1].masks' does not fit its architecture"),
    (lambda b: b["tickets"][1]["masks"].__setitem__("output.weight", torch.ones(3, 3, dtype=torch.bool)),
     "'tickets[1].masks.output.weight' has shape (3, 3)"),
    (lambda b: b["next_masks"].__setitem__("extra.weight", torch.ones(1)), "'next_masks' does not fit"),
    (lambda b: b["tickets"][1].__setitem__("trained", [1.0]), "'tickets[1].trained' has the wrong type (list)"),
    (lambda b: b["tickets"][1]["trained"].pop("output.bias"), "'tickets[1].trained' does not fit its architecture"),
    (lambda b: b["tickets"][1]["trained"].__setitem__("output.bias", torch.zeros(3)),
     "'tickets[1].trained.output.bias' has shape (3,)"),
    (lambda b: b["tickets"][1]["trained"].__setitem__("output.bias", torch.zeros(10, dtype=torch.int64)),
     "'tickets[1].trained.output.bias' has dtype torch.int64"),
    (lambda b: b["tickets"][1]["trained"].__setitem__("hidden.0.weight", torch.ones(16, 64)),
     "'tickets[1].trained.hidden.0.weight' is non-zero where the mask prunes it"),
    (lambda b: b["theta0"].__setitem__("output.bias", torch.zeros(3)), "'theta0.output.bias' has shape"),
    (lambda b: b.__setitem__("architecture", {}), "'architecture' is invalid"),
    (lambda b: b["privacy"].pop("dp_event"), "lacks 'privacy.dp_event'"),
    (lambda b: b["privacy"].__setitem__("dp_event", {"type": "Nonsense"}), "'privacy.dp_event' is not a DpEvent"),
    (lambda b: b["privacy"].__setitem__("epsilon", 0.0), "'privacy' holds unknown ['epsilon']"),
]


@pytest.mark.parametrize(("edit", "fragment"), DAMAGE, ids=[d[1] for d in DAMAGE])
def test_a_damaged_file_is_refused_in_one_line(tmp_path: Path, edit: Any, fragment: str) -> None:
    path = tmp_path / "t.pt"
    body = ticket_set().to_dict()
    edit(body)
    torch.save(body, path)
    message = _refused(path)
    assert "is a damaged 'tickets' checkpoint" in message and fragment in message, message


def test_a_winner_is_no_ticket_set(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    save_atomic(winner().to_dict(), path, "ticket")
    with pytest.raises(DpltmUserError, match=r"is a winner, not a ticket set: .*dpltm train --ticket"):
        load_ticket_set(path)


def test_a_set_written_with_copies_of_its_data_in_privacy_reads_them_from_data() -> None:
    """Ticket sets written before kept phase 1's dataset, split, fingerprint and note in `privacy` too:
    read and dropped; `privacy_view` shows them from `data` (what inspect prints, unchanged)."""
    from dpltm.artefacts.ticket_set import PHASE1_NOTE

    body = ticket_set().to_dict()
    body["privacy"].update(dataset="kmnist", split="test", fingerprint="abc123", note="old words")
    read = TicketSet.from_dict(body, "old.pt")
    assert set(read.privacy.to_dict()) == {"phase1", "dp_event"}
    assert read.privacy_view == {**read.privacy.to_dict(), "dataset": "kmnist", "split": "test",
                                 "fingerprint": "abc123", "note": PHASE1_NOTE}


def test_inspect_prints_a_ticket_set_whose_data_record_lacks_its_sizes() -> None:
    """A ticket set whose data record keeps no n_val/n_test (it loads) printed a KeyError traceback in inspect."""
    import io

    from rich.console import Console

    from dpltm.ticket_views import print_tickets

    out = io.StringIO()
    print_tickets(ticket_set(), Console(file=out, width=200))
    assert "data: 900 train / ? val / ? test" in out.getvalue()


def test_inspect_cells_round_every_privacy_parameter_the_safe_way() -> None:
    """ε, δ and q up, σ down: the guarantee a table shows is never stronger than the one computed (the table once
    printed σ 1.23457 for 1.23456789 and δ 1.23456e-06 for 1.2345649e-06)."""
    from dpltm.ticket_views import cell

    assert cell("training.sigma", 1.23456789) == "1.23456" and cell("noise_multiplier", 1.3479157) == "1.34791"
    assert cell("delta", 1.2345649e-6) == "1.23457e-06" and float(cell("delta", 1.2345649e-6)) >= 1.2345649e-6
    assert float(cell("training.q", 0.04791011)) >= 0.04791011 and cell("epsilon", 0.70061) == "0.7007"
    assert cell("lr", 0.123456789) == "0.123457"  # not a privacy figure: to nearest
