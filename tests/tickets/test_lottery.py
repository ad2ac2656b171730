"""Iterative magnitude pruning end to end on tiny data: schedule, records, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpltm.checkpoint import load_checkpoint, load_ticket_set
from dpltm.errors import DpltmUserError
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings
from dpltm.tickets.imp import generate_tickets


def small_config(**generate: object) -> GenerateConfig:
    settings = {"rounds": 3, "iterations": 30, "batch_size": 64, "lr": 0.2, "log_every": 10}
    settings.update(generate)
    return GenerateConfig(data=DataSettings(dataset="blobs"), model=ModelSettings(hidden=(16, 8)),
                          generate=GenerateSettings(**settings), seed=7)  # type: ignore[arg-type]


def test_schedule_records_and_phase1_label(tiny_splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "t.pt"
    payload = generate_tickets(small_config(), tiny_splits, out, progress=False).to_dict()
    tickets = payload["tickets"]
    assert [t["round"] for t in tickets] == [0, 1, 2, 3]
    assert tickets[0]["density"] == 1.0
    # paper schedule: 30 % of survivors per hidden layer, 20 % for the output layer
    for t in tickets:
        k = t["round"]
        assert t["layer_density"]["hidden.0.weight"] == pytest.approx(0.7**k, abs=0.02)
        assert t["layer_density"]["output.weight"] == pytest.approx(0.8**k, abs=0.04)
    for earlier, later in zip(tickets, tickets[1:]):
        for name, mask in later["masks"].items():
            assert not bool((mask & ~earlier["masks"][name]).any())  # nested
    assert all(0.0 <= t["val_accuracy"] <= 1.0 for t in tickets)
    assert len(tickets[0]["loss_curve"]) == 3
    assert payload["privacy"]["phase1"] == "non-private"
    assert payload["privacy"]["dp_event"] == {"type": "NonPrivateDpEvent"}
    body = load_checkpoint(out, "tickets")
    assert body["complete"] and body["data"]["fingerprint"] == "blobs-v1"
    assert set(body["theta0"]) >= {"hidden.0.weight", "output.bias"}


def test_resume_after_interruption_gives_identical_tickets(tiny_splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = small_config()
    whole = generate_tickets(cfg, tiny_splits, tmp_path / "whole.pt", progress=False)
    part = tmp_path / "part.pt"
    first = generate_tickets(cfg, tiny_splits, part, progress=False, stop_after=2)
    assert not first.complete and len(first.tickets) == 2
    resumed = generate_tickets(cfg, tiny_splits, part, progress=False)
    assert resumed.complete
    assert len(resumed.tickets) == len(whole.tickets)
    for a, b in zip(whole.tickets, resumed.tickets):
        assert a.val_accuracy == b.val_accuracy
        for name in a.masks:
            assert torch.equal(a.masks[name], b.masks[name])


def test_other_settings_do_not_silently_resume(tiny_splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "t.pt"
    generate_tickets(small_config(rounds=1), tiny_splits, out, progress=False)
    with pytest.raises(DpltmUserError, match="--overwrite"):
        generate_tickets(small_config(rounds=1, lr=0.3), tiny_splits, out, progress=False)
    again = generate_tickets(small_config(rounds=1, lr=0.3), tiny_splits, out, progress=False,
                             overwrite=True)
    assert again.config["generate"]["lr"] == 0.3


def test_min_density_floor_and_controls(tiny_splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tickets = generate_tickets(small_config(rounds=10, min_density=0.45, controls=True),
                               tiny_splits, tmp_path / "t.pt", progress=False)
    densities = [t.density for t in tickets.tickets]
    assert min(densities) >= 0.45 and len(densities) < 11
    assert "below --min-density" in (tickets.stop_reason or "")
    assert tickets.tickets[0].controls is None
    controls = tickets.tickets[1].controls or {}
    assert set(controls) == {"reinit", "random_mask"}


def test_prune_rates_must_match_layers(tiny_splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DpltmUserError, match="one per layer"):
        generate_tickets(small_config(prune_rates=(0.3, 0.2)), tiny_splits, tmp_path / "t.pt",
                         progress=False)


def test_each_ticket_keeps_the_weights_its_round_trained(tiny_splits, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --rewind public` starts from a ticket's `trained` weights: they must be the network as that
    round's training left it (before pruning: the next mask prunes their smallest), zero where it prunes."""
    import dpltm.training.plain as plain
    from dpltm.pruning import prune_layerwise

    after_training: list[dict[str, torch.Tensor]] = []

    def recording(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(model, *args, **kwargs)
        after_training.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return result

    real = plain.train_classifier
    monkeypatch.setattr(plain, "train_classifier", recording)  # what generation imports when it trains
    out = tmp_path / "t.pt"
    generate_tickets(small_config(), tiny_splits, out, progress=False)
    tickets = load_ticket_set(out).tickets
    assert len(after_training) == len(tickets) == 4
    for ticket, state in zip(tickets, after_training):
        assert ticket.trained is not None and set(ticket.trained) == set(state)
        for key, value in state.items():
            assert ticket.trained[key].device.type == "cpu" and torch.equal(ticket.trained[key], value)
        for name, mask in ticket.masks.items():
            assert torch.count_nonzero(ticket.trained[name][~mask]) == 0
        assert not torch.equal(ticket.trained["hidden.0.bias"], load_ticket_set(out).theta0["hidden.0.bias"])
    rates = load_ticket_set(out).prune_rates
    for ticket, following in zip(tickets, tickets[1:]):
        weights = {name: ticket.trained[name] for name in ticket.masks}
        pruned = prune_layerwise(weights, ticket.masks, rates)
        assert all(torch.equal(pruned[n], following.masks[n]) for n in pruned)
