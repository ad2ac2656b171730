"""select → train end to end on small files: the privacy statement in each mode, transfer,
baselines, budget stopping, and the stored ledger re-deriving the printed ε."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpltm.checkpoint import load_checkpoint
from dpltm.privacy.accounting import epsilon
from dpltm.privacy.ledger import PrivacyLedger
from tests.datafiles import write_digits, write_har, write_mnist

FAST_GEN = ["--rounds", "2", "--iterations", "15", "--batch-size", "16", "--device", "cpu", "--no-progress"]
FAST_TRAIN = ["--epochs", "2", "--batch-size", "16", "--device", "cpu", "--no-progress", "--json"]


@pytest.fixture(scope="session")
def invoke(cli):  # type: ignore[no-untyped-def]
    def run(*args: str) -> dict:  # type: ignore[type-arg]
        result = cli(*args)
        return json.loads(result.stdout) if "--json" in args else {"stderr": result.stderr}

    return run


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_digits(root)
    write_mnist(root, "MNIST", n_train=120, n_test=30)
    write_mnist(root, "FashionMNIST", n_train=120, n_test=30)
    write_har(root, n_train=60, n_test=20)
    return root


@pytest.fixture(scope="module")
def digits_winner(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli, invoke) -> Path:
    folder = tmp_path_factory.mktemp("digits")
    invoke("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN,
           "--out", str(folder / "t.pt"))
    result = cli("select", "--tickets", str(folder / "t.pt"), "--eps1", "0.1", "--seed", "3",
                 "--out", str(folder / "w.pt"))
    assert "close to uniform" in result.stderr  # ν = 50 ⇒ Δ = 49: the paper's selection is a coin toss
    return folder / "w.pt"


def test_same_data_mode_is_labelled_not_end_to_end(data_root: Path, digits_winner: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "m.pt"
    result = cli("train", "--ticket", str(digits_winner), "--dataset", "digits", "--data-dir",
                 str(data_root), "--eps2", "0.9", "--out", str(out), *FAST_TRAIN)
    report = json.loads(result.stdout)
    assert report["end_to_end_dp"] is False
    assert "NOT end-to-end" in result.stderr
    assert report["privacy"]["overall_epsilon"] == "inf"
    # the whole run's ε is infinite; the DP part (ε1 = 0.1 selection + training calibrated to 0.9)
    # is composed no worse than basic composition, and says what it covers
    assert report["epsilon"] == "inf"
    assert report["epsilon_dp_part"] <= 1.0 + 1e-9
    assert report["epsilon_scope"] == "selection and training only (phases 2-3)"
    assert "train_loss" not in json.dumps(report)
    body = load_checkpoint(out, "model")
    ledger = PrivacyLedger.from_json(body["privacy"]["ledger"])
    assert ledger.phase1 == "same-data" and ledger.selection_eps1 == 0.1
    assert body["privacy"]["ledger"]["dp_event"]["events"][0]["type"] == "NonPrivateDpEvent"
    assert ledger.best_bound().epsilon == pytest.approx(report["epsilon_dp_part"])
    assert report["randomness"] == "OS CSPRNG seed, not stored"
    assert not any(k in record for record in body["history"] for k in ("train_loss", "clipped_fraction"))
    assert len(body["history"]) == 2 and (Path(report["log_dir"]) / "metrics.csv").exists()
    state = body["state_dict"]
    for name in ("hidden_0", "hidden_1", "output"):
        mask = state[f"mask_{name}_weight"]
        assert torch.count_nonzero(state[name.replace("_", ".") + ".weight"][~mask]) == 0


def test_public_tickets_are_end_to_end_and_calibrated(data_root: Path, tmp_path: Path, invoke) -> None:
    invoke("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(tmp_path / "t.pt"))
    invoke("select", "--tickets", str(tmp_path / "t.pt"), "--best", "--out", str(tmp_path / "w.pt"))
    report = invoke("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "fashion-mnist", "--data-dir",
                    str(data_root), "--eps2", "0.5", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN)
    assert report["end_to_end_dp"] is True and report["composition"] == "training-only"
    assert report["transfer"]["mode"] == "direct"
    assert report["epsilon"] <= 0.5
    # the printed ε is the accountant's ε for exactly what ran (q, σ, steps)
    training = report["privacy"]["training"]
    event = PrivacyLedger.from_json(load_checkpoint(tmp_path / "m.pt", "model")["privacy"]["ledger"]).training_event()
    assert training["steps"] == report["steps"]
    assert epsilon(event, 1e-5, "pld") == pytest.approx(report["epsilon"])
    assert report["epsilon"] > 0.45  # calibration is tight, not wildly conservative


def test_cross_architecture_transfer_keeps_hidden_masks(data_root: Path, tmp_path: Path, invoke) -> None:
    invoke("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN, "--project-to", "561",
           "--out", str(tmp_path / "t.pt"))
    invoke("select", "--tickets", str(tmp_path / "t.pt"), "--best", "--out", str(tmp_path / "w.pt"))
    report = invoke("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "har", "--data-dir", str(data_root),
                    "--sigma", "1.0", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN)
    assert report["transfer"]["mode"] == "cross-architecture"
    assert set(report["transfer"]["dropped_layers"]) == {"project", "output"}
    winner = load_checkpoint(tmp_path / "w.pt", "ticket")
    model = load_checkpoint(tmp_path / "m.pt", "model")
    assert torch.equal(model["state_dict"]["mask_hidden_0_weight"], winner["masks"]["hidden.0.weight"])
    assert bool(model["state_dict"]["mask_output_weight"].all())  # fresh output layer for 6 classes
    assert model["architecture"]["num_classes"] == 6 and model["architecture"]["in_features"] == 561


def test_incompatible_ticket_is_a_clear_error(data_root: Path, digits_winner: Path, tmp_path: Path, cli) -> None:
    result = cli("train", "--ticket", str(digits_winner), "--dataset", "har", "--data-dir",
                 str(data_root), "--out", str(tmp_path / "m.pt"), *FAST_TRAIN, ok=False)
    assert result.exit_code == 2 and "--project-to 561" in result.stderr


def test_dense_and_non_private_baselines(data_root: Path, tmp_path: Path, invoke) -> None:
    dense = invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--eps2", "1.0",
                   "--out", str(tmp_path / "d.pt"), *FAST_TRAIN)
    assert dense["end_to_end_dp"] is True and dense["density"] == 1.0
    plain = invoke("train", "--dense", "--non-private", "--dataset", "digits", "--data-dir", str(data_root),
                   "--out", str(tmp_path / "n.pt"), *FAST_TRAIN)
    assert plain["private"] is False and plain["end_to_end_dp"] is False
    assert plain["privacy"]["overall_epsilon"] == "inf"


def test_target_eps_stops_before_overspending(data_root: Path, tmp_path: Path, cli, invoke) -> None:
    report = invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma", "1.0",
                    "--max-eps", "2.0", "--out", str(tmp_path / "d.pt"), "--epochs", "30", "--batch-size", "16",
                    "--device", "cpu", "--no-progress", "--json")
    assert report["epochs_run"] < 30 and "--max-eps" in report["stop_reason"]
    assert report["epsilon"] <= 2.0
    result = cli("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma",
                 "0.7", "--max-eps", "0.5", "--batch-size", "16", "--device", "cpu", ok=False)
    assert result.exit_code == 2 and "within the first epoch" in result.stderr


def test_patience_reports_its_caveat(data_root: Path, tmp_path: Path, invoke) -> None:
    report = invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma", "50",
                    "--lr", "1e-12", "--patience", "1", "--out", str(tmp_path / "d.pt"), "--epochs", "8",
                    "--batch-size", "16", "--device", "cpu", "--no-progress", "--json", "--noise-seed", "1")
    # lr ≈ 0: validation accuracy cannot improve, so patience 1 stops after epoch 2
    assert report["epochs_run"] == 2 and "--patience" in report["stop_reason"]
    # stopped adaptively: the guarantee is the planned run's budget, and the run is flagged
    assert report["caveats"] and report["end_to_end_dp"] is False and report["epsilon"] == "inf"
    assert report["epsilon_spent_at_stop"] is None  # after an adaptive stop it would be no guarantee


def test_train_user_errors(data_root: Path, digits_winner: Path, tmp_path: Path, cli) -> None:
    for args, message in (
        (["train", "--dataset", "digits"], "--ticket"),
        (["train", "--dense", "--ticket", str(digits_winner)], "drop --ticket"),
        (["train", "--ticket", str(tmp_path / "none.pt")], "does not exist"),
        (["train", "--dense", "--eps2", "-1"], "--eps must lie in (0, 100]"),
        (["train", "--dense", "--optimizer", "rmsprop"], "--optimizer"),
        (["train", "--dense", "--dataset", "digits", "--batch-size", "100000"], "smaller than the training set"),
    ):
        result = cli(*args, "--data-dir", str(data_root), "--device", "cpu", ok=False)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and "Traceback" not in result.output


def test_run_chains_the_three_stages(data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     cli, invoke) -> None:
    monkeypatch.chdir(tmp_path)
    report = invoke("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
                    "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1",
                    "--eps", "1.0", "--batch-size", "16", "--device", "cpu", "--no-progress", "--json")
    assert report["end_to_end_dp"] is True and report["epsilon"] <= 1.0
    assert (tmp_path / "checkpoints" / "fashion-mnist-dpltm.pt").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "fashion-mnist-dpltm-tickets.pt", "fashion-mnist-dpltm-winner.pt",
        "fashion-mnist-dpltm.pt"]  # beside the model, nowhere else (logs: the suite's $DPLTM_LOG_DIR)
    again = cli("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--data-dir",
                str(data_root), "--device", "cpu", ok=False)
    assert again.exit_code == 2 and "pass --overwrite" in again.stderr


def test_run_adds_the_projection_when_input_sizes_differ(data_root: Path, tmp_path: Path, invoke) -> None:
    report = invoke("run", "--dataset", "digits", "--public-dataset", "mnist", "--public-split", "train",
                    "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1",
                    "--batch-size", "16", "--device", "cpu", "--no-progress", "--json", "--out",
                    str(tmp_path / "d.pt"))
    assert report["transfer"]["mode"] == "cross-architecture" and report["end_to_end_dp"] is True
    assert load_checkpoint(tmp_path / "d-tickets.pt", "tickets")["architecture"]["project_to"] == 64


def test_run_checks_everything_before_generating(data_root: Path, tmp_path: Path, cli) -> None:
    for args, message in (
        (["--dataset", "digits", "--project-to", "100"], "projection width must be 64"),
        (["--dataset", "isolet"], "ISOLET"),  # the private data is missing: said before any ticket
    ):
        result = cli("run", *args, "--public-dataset", "mnist", "--public-split", "train",
                     "--data-dir", str(data_root), "--device", "cpu", "--out", str(tmp_path / "m.pt"), ok=False)
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert not list(tmp_path.iterdir())


def test_every_selection_draw_is_counted(data_root: Path, tmp_path: Path, cli, invoke) -> None:
    invoke("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN, "--out", str(tmp_path / "t.pt"))
    first = invoke("select", "--tickets", str(tmp_path / "t.pt"), "--eps1", "0.1", "--out", str(tmp_path / "w1.pt"),
                   "--json")
    assert first["selection"]["draws"] == 1 and "test_accuracy" not in load_checkpoint(tmp_path / "w1.pt", "ticket")
    before = (tmp_path / "t.pt").read_bytes()
    refused = cli("select", "--tickets", str(tmp_path / "t.pt"), "--eps1", "0.2", "--out",
                  str(tmp_path / "w2.pt"), ok=False)
    assert refused.exit_code == 2 and "--reselect" in refused.stderr
    assert (tmp_path / "t.pt").read_bytes() == before and not (tmp_path / "w2.pt").exists()
    second = invoke("select", "--tickets", str(tmp_path / "t.pt"), "--eps1", "0.2", "--reselect", "--out",
                    str(tmp_path / "w2.pt"), "--json")
    assert second["selection"]["draws"] == 2 and second["selection"]["eps1_total"] == pytest.approx(0.3)
    assert load_checkpoint(tmp_path / "t.pt", "tickets")["selection_draws"] == [0.1, 0.2]
    report = invoke("train", "--ticket", str(tmp_path / "w2.pt"), "--dataset", "digits", "--data-dir",
                    str(data_root), "--sigma", "2", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN)
    ledger = PrivacyLedger.from_json(load_checkpoint(tmp_path / "m.pt", "model")["privacy"]["ledger"])
    assert ledger.selection_eps1 == pytest.approx(0.3) and ledger.selection_draws == 2
    assert "2 draws" in ledger.statement() and report["epsilon"] == "inf"
    # the basic-composition bound charges every draw: ε1 (0.1 + 0.2) + ε_train
    basic = next(b for b in ledger.bounds() if b.name == "basic-composition")
    training_only = epsilon(ledger.training_event(), 1e-5, "pld")
    assert basic.epsilon == pytest.approx(0.3 + training_only)


def test_public_tickets_assertion_is_checked_record_by_record(data_root: Path, tmp_path: Path, cli, invoke) -> None:
    # tickets from MNIST's official test split may train a model on MNIST's training split ...
    invoke("generate", "--dataset", "mnist", "--split", "test", "--data-dir", str(data_root), *FAST_GEN,
           "--val-fraction", "0.2", "--out", str(tmp_path / "t.pt"))
    invoke("select", "--tickets", str(tmp_path / "t.pt"), "--best", "--out", str(tmp_path / "w.pt"))
    report = invoke("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "mnist", "--public-tickets",
                    "--data-dir", str(data_root), "--sigma", "2", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN)
    assert report["end_to_end_dp"] is True and "asserted public" in report["caveats"][0]
    # ... but not on a pool that contains those same records
    result = cli("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "mnist", "--split", "all",
                 "--public-tickets", "--data-dir", str(data_root), "--sigma", "2", "--out",
                 str(tmp_path / "m2.pt"), *FAST_TRAIN, ok=False)
    assert result.exit_code == 2 and "private training records" in result.stderr, result.output
    assert not (tmp_path / "m2.pt").exists()


def test_dense_baseline_reads_the_model_section_of_a_config(data_root: Path, tmp_path: Path, invoke) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: {hidden: [32]}\n")
    invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma", "2", "--config",
           str(config), "--out", str(tmp_path / "d.pt"), *FAST_TRAIN)
    assert load_checkpoint(tmp_path / "d.pt", "model")["architecture"]["hidden"] == [32]


def test_released_ema_is_recomputed_from_the_dp_iterates(data_root: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, invoke) -> None:
    """EMA weights are a function of the DP iterates only (issue 9): record every iterate of a run
    with a fixed noise seed, recompute the EMA by hand, and compare with the checkpoint."""
    import dpltm.dp.step as dp_step

    invoke("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(tmp_path / "t.pt"))
    invoke("select", "--tickets", str(tmp_path / "t.pt"), "--best", "--out", str(tmp_path / "w.pt"))  # sparsest

    iterates: list[dict[str, torch.Tensor]] = []
    apply = dp_step.apply_gradients

    def recording(model, grads, optimizer, **hooks):  # type: ignore[no-untyped-def]
        apply(model, grads, optimizer, **hooks)
        iterates.append({k: v.detach().double().clone() for k, v in model.named_parameters()})

    monkeypatch.setattr(dp_step, "apply_gradients", recording)
    out = tmp_path / "m.pt"
    report = invoke("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "fashion-mnist", "--data-dir",
                    str(data_root), "--sigma", "1.0", "--ema", "0.9", "--ema-warmup", "--momentum", "0.5",
                    "--activation", "tanh", "--noise-seed", "5", "--out", str(out), *FAST_TRAIN)
    assert report["released_weights"] == "ema(0.9, warm-up)" and len(iterates) == report["steps"]
    assert report["transfer"]["activation_override"] == {"ticket": "relu", "used": "tanh"}
    ema = dict(iterates[0])
    for t, theta in enumerate(iterates[1:], start=1):  # TensorFlow's warm-up: d_t = min(0.9, (1 + t)/(10 + t))
        d = min(0.9, (1 + t) / (10 + t))
        ema = {k: d * ema[k] + (1 - d) * theta[k] for k in ema}
    body = load_checkpoint(out, "model")
    assert body["architecture"]["activation"] == "tanh"
    train = body["config"]["train"]
    assert (train["ema"], train["ema_warmup"], train["momentum"]) == (0.9, True, 0.5)
    state = body["state_dict"]
    for name, value in ema.items():
        torch.testing.assert_close(state[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(state[name].double(), iterates[-1][name])  # not the final iterate
    for layer in ("hidden_0", "hidden_1", "output"):
        mask = state[f"mask_{layer}_weight"]
        assert not bool(mask.all()) and torch.count_nonzero(state[layer.replace("_", ".") + ".weight"][~mask]) == 0
    assert body["history"][-1]["test_accuracy"] == report["test_accuracy"]


def test_recipe_options_reach_the_dense_baselines(data_root: Path, tmp_path: Path, cli, invoke) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: {activation: tanh}\ntrain: {momentum: 0.9, ema: 0.99}\n")
    dense = invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma", "2",
                   "--config", str(config), "--out", str(tmp_path / "d.pt"), *FAST_TRAIN)
    assert dense["released_weights"] == "ema(0.99)" and dense["transfer"] == {"mode": "dense", "activation": "tanh"}
    body = load_checkpoint(tmp_path / "d.pt", "model")
    assert body["architecture"]["activation"] == "tanh" and body["config"]["train"]["momentum"] == 0.9
    plain = invoke("train", "--dense", "--non-private", "--dataset", "digits", "--data-dir", str(data_root),
                   "--config", str(config), "--ema", "0.9", "--out", str(tmp_path / "n.pt"), *FAST_TRAIN)
    assert plain["released_weights"] == "ema(0.9)" and plain["transfer"]["activation"] == "tanh"
    default = invoke("train", "--dense", "--non-private", "--dataset", "digits", "--data-dir", str(data_root),
                     "--out", str(tmp_path / "p.pt"), *FAST_TRAIN)
    assert default["released_weights"] == "final iterate" and default["transfer"]["activation"] == "relu"
    for args, message in (
        (["--ema", "1.5"], r"--ema must lie in (0, 1)"),
        (["--ema-warmup"], "--ema-warmup (train.ema_warmup) warms up the moving average of the iterates: give its"),
        (["--momentum", "1"], r"--momentum must lie in [0, 1)"),
        (["--momentum", "0.9", "--optimizer", "adam"], "--momentum is for --optimizer sgd"),
        (["--activation", "gelu"], "'gelu' is not one of"),
        (["--noise-filter", "lowpass"], "'lowpass' is not one of"),
    ):
        result = cli("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root),
                     "--device", "cpu", "--out", str(tmp_path / "x.pt"), *args, ok=False)
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output, args
    assert not (tmp_path / "x.pt").exists()


def test_the_noise_filter_changes_the_steps_not_the_epsilon(data_root: Path, tmp_path: Path, invoke) -> None:
    """`--noise-filter doppler` (dpltm.dp.noise_filter): post-processing of the noisy gradients, so the same σ and ε
    as the run without it (same seeds), other weights, and the checkpoint's config says which filter ran."""
    runs = {}
    for name in ("none", "doppler"):
        runs[name] = invoke("train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--sigma", "2",
                            "--momentum", "0.5", "--noise-seed", "3", "--noise-filter", name,
                            "--out", str(tmp_path / f"{name}.pt"), *FAST_TRAIN)
    assert runs["doppler"]["epsilon"] == runs["none"]["epsilon"]
    assert runs["doppler"]["noise_multiplier"] == runs["none"]["noise_multiplier"] == 2.0
    filtered, plain = (load_checkpoint(tmp_path / f"{n}.pt", "model") for n in ("doppler", "none"))
    assert filtered["config"]["train"]["noise_filter"] == "doppler"
    assert plain["config"]["train"]["noise_filter"] == "none"
    assert not torch.equal(filtered["state_dict"]["output.weight"], plain["state_dict"]["output.weight"])


def test_generate_and_run_take_the_activation(data_root: Path, tmp_path: Path, invoke) -> None:
    report = invoke("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
                    "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1",
                    "--batch-size", "16", "--activation", "tanh", "--ema", "0.9", "--momentum", "0.5",
                    "--device", "cpu", "--no-progress", "--json", "--out", str(tmp_path / "m.pt"))
    assert report["released_weights"] == "ema(0.9)" and report["end_to_end_dp"] is True
    assert load_checkpoint(tmp_path / "m.pt", "model")["architecture"]["activation"] == "tanh"
    assert load_checkpoint(tmp_path / "m-tickets.pt", "tickets")["architecture"]["activation"] == "tanh"
    assert "activation_override" not in report["transfer"]  # tickets and training share the activation


def test_noise_aware_select_then_train_spends_nothing_on_the_private_data(data_root: Path, tmp_path: Path,
                                                                          invoke) -> None:
    invoke("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(tmp_path / "t.pt"))
    chosen = invoke("select", "--tickets", str(tmp_path / "t.pt"), "--noise-aware", "--private-size", "100",
                    "--eps2", "1", "--epochs", "2", "--batch-size", "16", "--data-dir", str(data_root),
                    "--device", "cpu", "--seed", "0", "--halving", "1", "--out", str(tmp_path / "w.pt"), "--json")
    selection = chosen["selection"]
    assert selection["method"] == "noise-aware" and selection["eps1"] is None
    candidates = selection["noise_aware"]["candidates"]
    assert [c["round"] for c in candidates] == [0, 1, 2] and candidates[0]["density"] == 1.0
    assert sorted(c["steps"] for c in candidates) == [7, 14, 14] and candidates[0]["steps"] == 14  # halved at T/2
    assert selection["noise_aware"]["halving_rungs"] == [7]
    assert selection["noise_aware"]["public_data"]["fingerprint"] == chosen["ticket_data"]["fingerprint"]
    plan = selection["noise_aware"]["plan"]
    assert plan["steps"] == 2 * 7 and plan["expected_batch_size"] == 16  # ⌈100/16⌉ steps per epoch, 2 epochs
    report = invoke("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "fashion-mnist", "--data-dir",
                    str(data_root), "--eps2", "1", "--out", str(tmp_path / "m.pt"), *FAST_TRAIN)
    assert report["end_to_end_dp"] is True and report["composition"] == "training-only"
    ledger = PrivacyLedger.from_json(load_checkpoint(tmp_path / "m.pt", "model")["privacy"]["ledger"])
    assert ledger.selection_eps1 is None and type(ledger.selection_event()).__name__ == "NoOpDpEvent"


def test_run_with_the_tuned_recipe_sets_lr_from_sigma(data_root: Path, tmp_path: Path, invoke) -> None:
    report = invoke("run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
                    "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1",
                    "--batch-size", "16", "--recipe", "tuned", "--device", "cpu", "--no-progress", "--json",
                    "--search", "none",  # the recipe's own release: no variant chosen over it
                    "--out", str(tmp_path / "m.pt"))
    body = load_checkpoint(tmp_path / "m.pt", "model")
    train = body["config"]["train"]
    assert train["lr_sigma"] == 6.0 and train["lr"] == pytest.approx(6.0 / report["noise_multiplier"])
    assert body["architecture"]["activation"] == "tanh" and report["released_weights"] == "ema(0.999)"
    assert report["end_to_end_dp"] is True and report["epsilon"] <= 1.0
    assert body["ticket"]["selection"]["noise_aware"]["plan"]["lr"] == pytest.approx(train["lr"])


@pytest.mark.parametrize("source", [["--public-dataset", "mnist", "--public-split", "train", "--rounds", "1",
                                     "--iterations", "10"], ["--ticket-source", "private", "--warmup-epochs", "1"]],
                         ids=["public tickets", "private ticket"])
def test_run_takes_a_noise_seed_for_every_phase(source: list[str], data_root: Path, tmp_path: Path, invoke) -> None:
    """`run --noise-seed S` seeds the noise and sampling of its DP phases (a private ticket's warm-up too): the same S
    gives the same model bit for bit, another S another; the report says the seed was the user's."""
    def run(seed: int, out: str) -> dict[str, Any]:
        report = invoke("run", "--dataset", "digits", "--data-dir", str(data_root), *source, "--epochs", "2",
                        "--batch-size", "16", "--device", "cpu", "--noise-seed", str(seed), "--no-progress", "--json",
                        "--out", str(tmp_path / out))
        assert report["end_to_end_dp"] is True and "user-given seed" in json.dumps(report)
        return load_checkpoint(tmp_path / out, "model")["state_dict"]

    first, again, other = run(3, "a.pt"), run(3, "b.pt"), run(4, "c.pt")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())
