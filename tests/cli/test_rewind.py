"""`train --rewind public`: a ticket's DP training starts from the weights its public IMP round ended
with (θ0's output layer under the default `--output-layer reinit`), pruned weights stay exactly zero,
the public weights add nothing to the ledger, and files from before they were kept, tickets made on
the private data and bad combinations are each refused in one line (hostile values of the flags:
tests/cli/test_bad_inputs.py). `train --rewind K`: a ticket from a late-rewound set (`generate --rewind-step K`)
starts from θ_K, the dense network's weights K steps into public training, under its mask, with the same
guarantees and refusals; `run --rewind K` makes its tickets so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpltm.checkpoint import load_checkpoint, load_ticket_set, load_winner
from dpltm.errors import DpltmUserError
from dpltm.training.pipeline import TicketOrigin, check_start
from dpltm.training.transfer import model_from_ticket
from tests.datafiles import write_digits, write_mnist

FAST_GEN = ["--rounds", "2", "--iterations", "15", "--batch-size", "16", "--device", "cpu", "--no-progress"]
K = 6
"""The late-rewinding step of the `--rewind K` tests."""
FAST_TRAIN = ["--epochs", "2", "--batch-size", "16", "--eps2", "0.5", "--device", "cpu", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_digits(root)
    write_mnist(root, "MNIST", n_train=120, n_test=30)
    write_mnist(root, "FashionMNIST", n_train=120, n_test=30)
    return root


@pytest.fixture(scope="module")
def public_winner(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:  # type: ignore[no-untyped-def]
    """A winner of MNIST tickets (public for a Fashion-MNIST run): same shape and class count (direct)."""
    folder = tmp_path_factory.mktemp("public")
    cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(folder / "t.pt"))
    cli("select", "--tickets", str(folder / "t.pt"), "--best", "--out", str(folder / "w.pt"))
    return folder / "w.pt"


def _train(cli, data_root: Path, winner: Path, out: Path, *extra: str, ok: bool = True) -> Any:  # type: ignore[no-untyped-def]
    return cli("train", "--ticket", str(winner), "--dataset", "fashion-mnist", "--data-dir", str(data_root),
               "--out", str(out), "--seed", "1", *FAST_TRAIN, *extra, ok=ok)


def _one_line_error(result: Any, fragment: str) -> None:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_the_winner_carries_its_rounds_trained_weights(public_winner: Path, cli) -> None:  # type: ignore[no-untyped-def]
    winner = load_winner(public_winner)
    tickets = load_checkpoint(Path(winner.source["tickets"]), "tickets")
    chosen = next(t for t in tickets["tickets"] if t["round"] == winner.round)
    assert winner.public_weights is not None and set(winner.public_weights) == set(winner.theta0)
    shown = cli("inspect", str(public_winner), "--json")
    assert json.loads(shown.stdout)["public_weights"] is True
    assert "kept (train --rewind public)" in cli("inspect", str(public_winner)).stdout
    for key, value in chosen["trained"].items():
        assert torch.equal(winner.public_weights[key], value), key


def test_the_start_weights_by_output_layer(public_winner: Path) -> None:
    ticket = load_winner(public_winner)
    public, theta0, masks = ticket.public_weights or {}, ticket.theta0, ticket.masks
    model, installed, record = model_from_ticket(ticket, 784, 10, seed=0, start="public")
    assert record.rewind == "public" and record.output_layer == "reinit"
    for key, value in model.state_dict().items():
        expected = theta0[key] if key.startswith("output.") else public[key]
        expected = expected * masks[key] if key in masks else expected
        assert torch.equal(value, expected), key
    kept, _, record = model_from_ticket(ticket, 784, 10, seed=0, start="public", output_layer="keep")
    assert record.output_layer == "keep"
    assert all(torch.equal(v, public[k]) for k, v in kept.state_dict().items())
    from_theta0, _, record = model_from_ticket(ticket, 784, 10, seed=0)
    assert record.rewind == "init" and record.output_layer is None
    assert all(torch.equal(v, theta0[k] * masks[k] if k in masks else theta0[k])
               for k, v in from_theta0.state_dict().items())
    with pytest.raises(DpltmUserError, match="trained for 10 classes, this data has 6"):
        model_from_ticket(ticket, 784, 6, seed=0, start="public", output_layer="keep")


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The weights each DP training run of the test starts from (recorded just before its first step)."""
    import dpltm.training.pipeline as pipeline

    recorded: list[dict[str, torch.Tensor]] = []
    real = pipeline.run_private

    def recording(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        recorded.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_private", recording)
    return recorded


def test_public_start_trains_from_the_public_weights_and_costs_nothing(  # type: ignore[no-untyped-def]
        public_winner: Path, data_root: Path, tmp_path: Path, cli, starts: list[dict[str, torch.Tensor]]) -> None:
    public = json.loads(_train(cli, data_root, public_winner, tmp_path / "p.pt", "--rewind", "public").stdout)
    init = json.loads(_train(cli, data_root, public_winner, tmp_path / "i.pt").stdout)
    winner = load_winner(public_winner)
    masks, weights = winner.masks, winner.public_weights
    assert weights is not None and len(starts) == 2
    for key, value in starts[0].items():  # before the first step: public weights, θ0's output layer, masked
        expected = winner.theta0[key] if key.startswith("output.") else weights[key]
        expected = expected * masks[key] if key in masks else expected
        assert torch.equal(value, expected), key
    assert not torch.equal(starts[0]["hidden.0.weight"], starts[1]["hidden.0.weight"])
    assert public["transfer"]["rewind"] == "public" and public["transfer"]["output_layer"] == "reinit"
    assert init["transfer"]["rewind"] == "init"
    state = load_checkpoint(tmp_path / "p.pt", "model")["state_dict"]
    for name, mask in masks.items():  # the pruned weights stayed exactly zero through DP training
        assert torch.count_nonzero(state[name][~mask.bool()]) == 0, name
        assert torch.equal(state[f"mask_{name.replace('.', '_')}"], mask.bool())
    # public weights are public: the same plan spends exactly the same ε
    assert public["end_to_end_dp"] is True and public["epsilon"] == init["epsilon"]
    assert (load_checkpoint(tmp_path / "p.pt", "model")["privacy"]["ledger"]
            == load_checkpoint(tmp_path / "i.pt", "model")["privacy"]["ledger"])


def test_files_without_public_weights_load_and_refuse_a_public_start(  # type: ignore[no-untyped-def]
        public_winner: Path, data_root: Path, tmp_path: Path, cli) -> None:
    old_set = load_checkpoint(Path(load_winner(public_winner).source["tickets"]), "tickets")
    for record in old_set["tickets"]:
        del record["trained"]
    torch.save(old_set, tmp_path / "old-t.pt")
    cli("select", "--tickets", str(tmp_path / "old-t.pt"), "--best", "--out", str(tmp_path / "old-w.pt"))
    assert load_winner(tmp_path / "old-w.pt").public_weights is None
    old_winner = load_checkpoint(public_winner, "ticket")
    del old_winner["public_weights"]
    torch.save(old_winner, tmp_path / "old.pt")
    assert load_winner(tmp_path / "old.pt").public_weights is None
    for winner in (tmp_path / "old-w.pt", tmp_path / "old.pt"):
        result = _train(cli, data_root, winner, tmp_path / "m.pt", "--rewind", "public", ok=False)
        _one_line_error(result, "holds no public-trained weights")
        assert not (tmp_path / "m.pt").exists()


def test_a_public_start_is_refused_for_tickets_made_on_the_private_data(  # type: ignore[no-untyped-def]
        data_root: Path, tmp_path: Path, cli) -> None:
    cli("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN, "--out", str(tmp_path / "t.pt"))
    cli("select", "--tickets", str(tmp_path / "t.pt"), "--best", "--out", str(tmp_path / "w.pt"))
    result = cli("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "digits", "--data-dir", str(data_root),
                 "--rewind", "public", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN, ok=False)
    _one_line_error(result, "the private dataset, so starting from their weights is not DP")
    assert not (tmp_path / "m.pt").exists()
    private = TicketOrigin("private", "digits (train split)", None, "made with privacy")
    with pytest.raises(DpltmUserError, match="refused for a private ticket"):
        check_start("public", "reinit", {"private_ticket": {}}, private)
    check_start("init", "reinit", {"private_ticket": {}}, private)  # its own start: allowed


def test_bad_combinations_are_one_line(public_winner: Path, data_root: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.yaml"
    for extra, fragment, files in (
        (("--output-layer", "keep"), "--output-layer keep applies with --rewind public", None),
        (("--config", str(config)), "--rewind must be init, public or a step K ≥ 1", "train: {rewind: warmup}\n"),
        (("--config", str(config)), "train.output_layer=1 is not a valid string", "train: {output_layer: 1}\n"),
    ):
        if files is not None:
            config.write_text(files)
        result = _train(cli, data_root, public_winner, tmp_path / "m.pt", *extra, ok=False)
        _one_line_error(result, fragment)
    result = cli("train", "--dense", "--dataset", "digits", "--rewind", "public", "--data-dir", str(data_root),
                 ok=False)
    _one_line_error(result, "drop them with --dense")
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("start", ["public", "4"])
def test_run_passes_the_start_on(start: str, data_root: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """`run --rewind public` trains from the winner's public weights; `run --rewind 4` makes late-rewound tickets
    (generate --rewind-step 4) and trains from their θ_4."""
    result = cli("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
                 "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1", "--choice",
                 "best", "--rewind", start, "--batch-size", "16", "--device", "cpu", "--no-progress", "--json",
                 "--out", str(tmp_path / "m.pt"))
    report = json.loads(result.stdout)
    assert report["transfer"]["rewind"] == start and report["end_to_end_dp"] is True
    winner = load_winner(tmp_path / "m-winner.pt")
    assert winner.public_weights is not None
    late = start != "public"
    assert load_ticket_set(tmp_path / "m-tickets.pt").config["generate"]["rewind_step"] == (4 if late else 0)
    assert winner.rewind_step == (4 if late else None)


def test_a_public_start_in_another_activation_is_said_on_screen(  # type: ignore[no-untyped-def]
        public_winner: Path, data_root: Path, tmp_path: Path, cli) -> None:
    """The tickets were made in ReLU: public weights trained on in tanh start where public training never
    went. The run goes on (it may be meant), but says so on stderr as well as in the checkpoint."""
    result = _train(cli, data_root, public_winner, tmp_path / "t.pt", "--rewind", "public", "--activation", "tanh")
    report = json.loads(result.stdout)
    assert report["transfer"]["activation_override"] == {"ticket": "relu", "used": "tanh"}
    said = " ".join(result.stderr.split())  # rich wraps long lines
    assert "warning: the ticket's public weights were trained with relu; training them with tanh starts" in said
    init = _train(cli, data_root, public_winner, tmp_path / "i.pt", "--activation", "tanh")  # θ0: nothing to say
    assert "warning: the ticket's public weights" not in init.stderr


# ---- late rewinding: `--rewind K` ---------------------------------------------------------


@pytest.fixture(scope="module")
def late_winner(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:  # type: ignore[no-untyped-def]
    """A winner of MNIST tickets made with late rewinding to step K (public for a Fashion-MNIST run)."""
    folder = tmp_path_factory.mktemp("late")
    cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--rewind-step", str(K),
        "--out", str(folder / "t.pt"))
    cli("select", "--tickets", str(folder / "t.pt"), "--best", "--out", str(folder / "w.pt"))
    return folder / "w.pt"


def test_the_winner_carries_theta_k_under_its_mask(late_winner: Path, cli) -> None:  # type: ignore[no-untyped-def]
    winner = load_winner(late_winner)
    tickets = load_ticket_set(Path(winner.source["tickets"]))
    assert tickets.rewind_point is not None and winner.rewind_point is not None
    assert winner.rewind_point.step == tickets.rewind_point.step == K
    for key, value in tickets.rewind_point.weights.items():
        mask = winner.masks.get(key)
        assert torch.equal(winner.rewind_point.weights[key], value if mask is None else value * mask), key
    assert json.loads(cli("inspect", str(late_winner), "--json").stdout)["rewind_step"] == K
    assert json.loads(cli("inspect", winner.source["tickets"], "--json").stdout)["rewind_step"] == K


def test_start_k_trains_from_theta_k_and_costs_nothing(  # type: ignore[no-untyped-def]
        late_winner: Path, data_root: Path, tmp_path: Path, cli, starts: list[dict[str, torch.Tensor]]) -> None:
    late = json.loads(_train(cli, data_root, late_winner, tmp_path / "k.pt", "--rewind", f"0{K}").stdout)
    init = json.loads(_train(cli, data_root, late_winner, tmp_path / "i.pt").stdout)
    winner = load_winner(late_winner)
    assert winner.rewind_point is not None and len(starts) == 2
    theta_k, masks = winner.rewind_point.weights, winner.masks
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


def test_run_refuses_a_start_k_past_the_round(data_root: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    refused = cli("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--data-dir", str(data_root),
                  "--rounds", "1", "--iterations", "10", "--rewind", "10", "--device", "cpu", "--no-progress",
                  "--out", str(tmp_path / "n.pt"), ok=False)
    _one_line_error(refused, "--rewind 10 makes the public tickets with late rewinding to step 10, which must come")


def test_a_damaged_rewind_point_is_refused_in_one_line(late_winner: Path, tmp_path: Path) -> None:
    body = load_checkpoint(late_winner, "ticket")
    point = body["rewind_point"]
    acting = {k: torch.ones_like(v) for k, v in point["weights"].items()}
    not_finite = {k: torch.full_like(v, float("nan")) for k, v in point["weights"].items()}
    for damaged, fragment in (({**point, "step": 0}, "must be a step ≥ 1"),
                              ({**point, "step": True}, "wrong type"),
                              ({**point, "extra": 1}, "extra"),
                              ({**point, "weights": acting}, "non-zero where the mask"),
                              ({**point, "weights": not_finite}, "rewind_point.weights"),
                              ({"step": K}, "lacks 'rewind_point.weights'")):
        torch.save({**body, "rewind_point": damaged}, tmp_path / "bad.pt")
        with pytest.raises(DpltmUserError, match="damaged 'ticket' checkpoint") as caught:
            load_winner(tmp_path / "bad.pt")
        assert fragment in str(caught.value) and "\n" not in str(caught.value), (fragment, caught.value)
