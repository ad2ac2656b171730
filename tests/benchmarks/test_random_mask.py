"""The grid's random-mask control (issue 21): the winner's mask replaced by a random one of the same
per-layer density, drawn from the run seed alone — independent of any data — at θ0."""

from __future__ import annotations

from pathlib import Path

import torch
from grid.experiment import Experiment, Run

from dpltm.checkpoint import load_checkpoint, load_winner, save_atomic
from tests.cli.test_rewind import data_root, public_winner  # noqa: F401


def test_the_random_mask_keeps_each_layers_density_and_reads_no_data(
        tmp_path: Path, public_winner: Path) -> None:  # noqa: F811
    exp = Experiment({"name": "t"}, tmp_path / "grid", None, torch.device("cpu"))
    run = Run("fashion-mnist", "train", "random-mask", 1.0, 3)
    winner = load_winner(public_winner)
    control = load_winner(exp.random_mask(public_winner, run))
    assert control.public_weights is None and control.selection["method"] == "random"
    for name, mask in winner.masks.items():
        assert int(control.masks[name].sum()) == int(mask.sum())
    assert any(not torch.equal(control.masks[n], m) for n, m in winner.masks.items() if not bool(m.all()))
    # another mask of the same per-layer counts (other data would give another pattern): the same control
    body = load_checkpoint(public_winner, "ticket")
    shuffled = {n: m.flatten()[torch.randperm(m.numel(), generator=torch.Generator().manual_seed(9))].view(m.shape)
                for n, m in body["masks"].items()}
    other = {k: v for k, v in body.items() if k not in ("format", "kind", "format_version", "environment",
                                                        "public_weights")}
    other["masks"] = shuffled
    other["theta0"] = {k: v * shuffled[k] if k in shuffled else v for k, v in other["theta0"].items()}
    save_atomic(other, tmp_path / "other.pt", "ticket")
    again = load_winner(Experiment({"name": "t"}, tmp_path / "grid2", None, torch.device("cpu"))
                        .random_mask(tmp_path / "other.pt", run))
    assert all(torch.equal(again.masks[n], control.masks[n]) for n in control.masks)


def test_with_a_public_start_the_random_mask_starts_at_the_dense_public_weights(
        tmp_path: Path, public_winner: Path) -> None:  # noqa: F811
    """`rewind: public`: the control keeps the ticket's start (the dense public network) without its mask."""
    exp = Experiment({"name": "t"}, tmp_path / "grid", None, torch.device("cpu"))
    run = Run("fashion-mnist", "train", "random-mask", 1.0, 3)
    tickets = Path(load_winner(public_winner).source["tickets"])
    dense = next(t for t in load_checkpoint(tickets, "tickets")["tickets"] if t["round"] == 0)
    control = load_winner(exp.random_mask(public_winner, run, tickets))
    assert control.public_weights is not None
    for name, weight in dense["trained"].items():
        expected = weight * control.masks[name] if name in control.masks else weight
        assert torch.equal(control.public_weights[name], expected)
    # the same pattern as the θ0 control: the mask still comes from the run seed alone
    plain = load_winner(exp.random_mask(public_winner, run))
    assert all(torch.equal(plain.masks[n], control.masks[n]) for n in control.masks)
