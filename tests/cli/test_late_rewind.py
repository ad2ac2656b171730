"""`train --rewind K`: a ticket from a late-rewound set (`generate --rewind-step K`) starts from θ_K, the dense
network's weights K steps into public training, under its mask, with θ0's output layer; pruned weights stay exactly
zero; θ_K is public and adds nothing to the ledger; a K the ticket does not hold, the dense network, and tickets made
on the private data are refused in one line; `run --rewind K` makes its tickets so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpltm.checkpoint import load_checkpoint, load_ticket_set, load_winner
from tests.datafiles import write_digits, write_mnist

FAST_GEN = ["--rounds", "2", "--iterations", "15", "--batch-size", "16", "--device", "cpu", "--no-progress"]
FAST_TRAIN = ["--epochs", "2", "--batch-size", "16", "--eps2", "0.5", "--device", "cpu", "--no-progress", "--json"]
K = 6


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_digits(root)
    write_mnist(root, "MNIST", n_train=120, n_test=30)
    write_mnist(root, "FashionMNIST", n_train=120, n_test=30)
    return root


@pytest.fixture(scope="module")
def late_winner(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:  # type: ignore[no-untyped-def]
    """A winner of MNIST tickets made with late rewinding to step K (public for a Fashion-MNIST run)."""
    folder = tmp_path_factory.mktemp("late")
    cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--rewind-step", str(K),
        "--out", str(folder / "t.pt"))
    cli("select", "--tickets", str(folder / "t.pt"), "--best", "--out", str(folder / "w.pt"))
    return folder / "w.pt"


def _train(cli, data_root: Path, winner: Path, out: Path, *extra: str, ok: bool = True) -> Any:  # type: ignore[no-untyped-def]
    return cli("train", "--ticket", str(winner), "--dataset", "fashion-mnist", "--data-dir", str(data_root),
               "--out", str(out), "--seed", "1", *FAST_TRAIN, *extra, ok=ok)


def _one_line_error(result: Any, fragment: str) -> None:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_the_winner_carries_theta_k_under_its_mask(late_winner: Path, cli) -> None:  # type: ignore[no-untyped-def]
    winner = load_winner(late_winner)
    tickets = load_ticket_set(Path(winner.source["tickets"]))
    assert tickets.rewind_point is not None and winner.rewind_point is not None
    assert winner.rewind_point["step"] == tickets.rewind_point["step"] == K
    for key, value in tickets.rewind_point["weights"].items():
        mask = winner.masks.get(key)
        assert torch.equal(winner.rewind_point["weights"][key], value if mask is None else value * mask), key
    assert json.loads(cli("inspect", str(late_winner), "--json").stdout)["rewind_step"] == K
    assert json.loads(cli("inspect", winner.source["tickets"], "--json").stdout)["rewind_step"] == K


def test_start_k_trains_from_theta_k_and_costs_nothing(  # type: ignore[no-untyped-def]
        late_winner: Path, data_root: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpltm.training.pipeline as pipeline

    starts: list[dict[str, torch.Tensor]] = []
    real = pipeline.run_private

    def recording(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        starts.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_private", recording)
    late = json.loads(_train(cli, data_root, late_winner, tmp_path / "k.pt", "--rewind", f"0{K}").stdout)
    init = json.loads(_train(cli, data_root, late_winner, tmp_path / "i.pt").stdout)
    winner = load_winner(late_winner)
    assert winner.rewind_point is not None and len(starts) == 2
    theta_k, masks = winner.rewind_point["weights"], winner.masks
    for key, value in starts[0].items():  # before the first step: θ_K under the mask, θ0's output layer
        expected = winner.theta0[key] if key.startswith("output.") else theta_k[key]
        expected = expected * masks[key] if key in masks else expected
        assert torch.equal(value, expected), key
    assert not torch.equal(starts[0]["hidden.0.weight"], starts[1]["hidden.0.weight"])
    assert late["transfer"]["rewind"] == str(K) and late["transfer"]["output_layer"] == "reinit"
    state = load_checkpoint(tmp_path / "k.pt", "model")["state_dict"]
    for name, mask in masks.items():  # the pruned weights stayed exactly zero through DP training
        assert torch.count_nonzero(state[name][~mask.bool()]) == 0, name
    # θ_K came from public data: the same plan spends exactly the same ε, with the same ledger
    assert late["end_to_end_dp"] is True and late["epsilon"] == init["epsilon"]
    assert (load_checkpoint(tmp_path / "k.pt", "model")["privacy"]["ledger"]
            == load_checkpoint(tmp_path / "i.pt", "model")["privacy"]["ledger"])


def test_starts_it_cannot_take_are_one_line(late_winner: Path, data_root: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                            cli) -> None:
    _one_line_error(_train(cli, data_root, late_winner, tmp_path / "m.pt", "--rewind", str(K + 1), ok=False),
                    f"this ticket holds iterate {K} of public training (generate --rewind-step {K})")
    plain = tmp_path / "plain"
    cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(plain / "t.pt"))
    cli("select", "--tickets", str(plain / "t.pt"), "--best", "--out", str(plain / "w.pt"))
    _one_line_error(_train(cli, data_root, plain / "w.pt", tmp_path / "m.pt", "--rewind", str(K), ok=False),
                    "holds no iterate of public training")
    _one_line_error(cli("train", "--dense", "--dataset", "digits", "--rewind", str(K), "--data-dir", str(data_root),
                        ok=False), "drop them with --dense")
    for bad in ("0", "-3", "1.5", "K"):
        _one_line_error(_train(cli, data_root, late_winner, tmp_path / "m.pt", "--rewind", bad, ok=False),
                        "--rewind must be init, public or a step K ≥ 1")
    _one_line_error(cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--rewind-step",
                        "15", "--out", str(tmp_path / "t.pt"), ok=False), "--rewind-step must lie in [0, --iterations)")
    same = tmp_path / "same"
    cli("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN, "--rewind-step", "3",
        "--out", str(same / "t.pt"))
    cli("select", "--tickets", str(same / "t.pt"), "--best", "--out", str(same / "w.pt"))
    result = cli("train", "--ticket", str(same / "w.pt"), "--dataset", "digits", "--data-dir", str(data_root),
                 "--rewind", "3", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN, ok=False)
    _one_line_error(result, "the private dataset, so starting from their weights is not DP")
    assert not (tmp_path / "m.pt").exists()


def test_run_makes_late_rewound_tickets_for_start_k(data_root: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
                 "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1", "--choice",
                 "best", "--rewind", "4", "--batch-size", "16", "--device", "cpu", "--no-progress", "--json",
                 "--out", str(tmp_path / "m.pt"))
    report = json.loads(result.stdout)
    assert report["transfer"]["rewind"] == "4" and report["end_to_end_dp"] is True
    assert load_ticket_set(tmp_path / "m-tickets.pt").config["generate"]["rewind_step"] == 4
    winner = load_winner(tmp_path / "m-winner.pt")
    assert winner.rewind_point is not None and winner.rewind_point["step"] == 4
    refused = cli("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--data-dir", str(data_root),
                  "--rounds", "1", "--iterations", "10", "--rewind", "10", "--device", "cpu", "--no-progress",
                  "--out", str(tmp_path / "n.pt"), ok=False)
    _one_line_error(refused, "--rewind-step must lie in [0, --iterations)")
