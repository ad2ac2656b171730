"""Private tickets (issue 9, part 2): a ticket made on the private data by DP warm-up, composed with
training into one guarantee that meets the user's ε."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
import torch

from dpltm.checkpoint import load_checkpoint, load_winner
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.privacy.ledger import PrivacyLedger
from dpltm.privacy.pld_accountant import PLD_VALUE_DISCRETIZATION_INTERVAL
from dpltm.pruning.magnitude import prune_input_features
from dpltm.settings import PrivateTicketSettings, TrainConfig, TrainSettings
from dpltm.tickets.private import (
    check_private_prune,
    layer_keep_fractions,
    make_private_ticket,
    plan_private_ticket,
    round_prune_rates,
)
from dpltm.training.pipeline import train


def _config(eps: float = 2.0, warmup: int = 2, epochs: int = 3, rounds: int = 1, density_: float = 0.3,
            rewind: str = "warmup", ema: float | None = None) -> TrainConfig:
    return TrainConfig(
        train=TrainSettings(epochs=epochs, batch_size=64, lr=0.5, eps2=eps, ema=ema),
        model=dataclasses.replace(TrainConfig().model, hidden=(16, 8)),
        private_ticket=PrivateTicketSettings(warmup_epochs=warmup, rounds=rounds, density=density_, rewind=rewind),
    )


def _independent_pld_epsilon(phases: list[tuple[float, float, int]], delta: float) -> float:
    """dp-accounting's own PLD accountant, fed the same events by hand."""
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    for q, sigma, steps in phases:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("target", [0.05, 0.25, 0.6])
def test_layer_keep_fractions_reach_the_target_density(target: float) -> None:
    arch = build_architecture(784, 10, (300, 100), None)
    keep = layer_keep_fractions(arch, target)
    sizes = {f"{n}.weight": a * b for n, (a, b) in arch.layer_shapes().items()}
    assert sum(sizes[n] * keep[n] for n in sizes) / sum(sizes.values()) == pytest.approx(target, rel=1e-9)
    assert keep["output.weight"] > keep["hidden.0.weight"]  # the paper's gentler output-layer rate
    rates = round_prune_rates(arch, target, rounds=3)
    for name, rate in rates.items():
        assert (1.0 - rate) ** 3 == pytest.approx(keep[name], rel=1e-12)


def test_plan_calibrates_one_sigma_for_the_whole_run(tiny_splits: DatasetSplits) -> None:
    cfg = _config(eps=1.0, warmup=2, epochs=3, rounds=2)
    plan = plan_private_ticket(cfg, len(tiny_splits.train))
    q, per_epoch = 64 / 512, 8
    phases = [(q, plan.noise_multiplier, 2 * per_epoch)] * 2 + [(q, plan.noise_multiplier, 3 * per_epoch)]
    eps = _independent_pld_epsilon(phases, 1e-5)
    assert eps <= 1.0
    assert eps > 0.99  # tight: the smallest σ that meets the target (within calibration tolerance)


def test_private_ticket_then_training_meets_the_requested_epsilon(tiny_splits: DatasetSplits,
                                                                  tmp_path: Path) -> None:
    cfg = _config(eps=2.0, warmup=2, epochs=3, density_=0.3)
    ticket_path = tmp_path / "ticket.pt"
    payload = make_private_ticket(cfg, tiny_splits, ticket_path, progress=False, noise_seed=1).to_dict()
    assert payload["density"] == pytest.approx(0.3, abs=0.01)
    # the start weights are zero wherever the mask prunes (masked DP warm-up weights)
    for name, mask in payload["masks"].items():
        key = name
        assert torch.all(payload["theta0"][key][~mask] == 0)
    ticket = load_winner(ticket_path)
    assert ticket.selection_method == "private" and ticket.is_private_ticket
    report = train(cfg, tiny_splits, tmp_path / "model.pt", ticket=ticket, ticket_path=ticket_path,
                   private=True, progress=False, noise_seed=2)
    assert report.end_to_end_dp is True
    assert report.composition == "private-ticket-composition"
    assert report.epsilon <= 2.0
    # the ledger's ε is dp-accounting's for the same events (warm-up with σ_a, training with σ_b)
    ledger = PrivacyLedger.from_json(load_checkpoint(tmp_path / "model.pt", ("model",))["privacy"]["ledger"])
    warmup, training = ledger.phase1_training[0], ledger.training
    independent = _independent_pld_epsilon(
        [(warmup["q"], warmup["sigma"], warmup["steps"]), (training["q"], training["sigma"], training["steps"])],
        1e-5)
    assert report.epsilon == pytest.approx(independent, rel=1e-9)
    assert independent <= 2.0
    # pruned weights stayed exactly zero through DP training
    model_body = load_checkpoint(tmp_path / "model.pt", ("model",))
    for name, mask in payload["masks"].items():
        key = name
        assert torch.all(model_body["state_dict"][key][~mask] == 0)
    assert "Ticket: made with privacy on blobs" in report.statement


def test_a_private_ticket_under_another_dataset_name_composes_its_warm_up(tiny_splits: DatasetSplits,
                                                                           tmp_path: Path) -> None:
    """Trained on data of another name (whose records may be the same people's), a private ticket's warm-up is
    still composed: ε equals an independent PLD over the warm-up and the training that ran."""
    cfg = _config(eps=2.0, warmup=2, epochs=3, density_=0.3)
    ticket_path = tmp_path / "ticket.pt"
    make_private_ticket(cfg, tiny_splits, ticket_path, progress=False, noise_seed=1)
    renamed = dataclasses.replace(tiny_splits, name="blobs-copy")
    report = train(cfg, renamed, tmp_path / "model.pt", ticket=load_winner(ticket_path), ticket_path=ticket_path,
                   private=True, progress=False, noise_seed=2)
    ledger = PrivacyLedger.from_json(load_checkpoint(tmp_path / "model.pt", ("model",))["privacy"]["ledger"])
    assert ledger.phase1 == "private" and ledger.phase1_training
    warmup, training = ledger.phase1_training[0], ledger.training
    independent = _independent_pld_epsilon(
        [(warmup["q"], warmup["sigma"], warmup["steps"]), (training["q"], training["sigma"], training["steps"])],
        1e-5)
    assert report.epsilon == pytest.approx(independent, rel=1e-9) and report.epsilon <= 2.0
    assert "Ticket: made with privacy on blobs (" in report.statement


def test_more_warmup_rounds_are_each_accounted(tiny_splits: DatasetSplits, tmp_path: Path) -> None:
    cfg = _config(eps=3.0, warmup=1, epochs=2, rounds=3, density_=0.2, rewind="init", ema=0.9)
    payload = make_private_ticket(cfg, tiny_splits, tmp_path / "t.pt", progress=False, noise_seed=3).to_dict()
    assert len(payload["private_ticket"]["warmup"]) == 3
    densities = [r["density"] for r in payload["private_ticket"]["rounds"]]
    assert densities == sorted(densities, reverse=True) and densities[-1] == pytest.approx(0.2, abs=0.01)
    # rewind to init: the start is θ0 (the seeded initialisation), masked
    init = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(cfg.seed))
    for key, value in payload["theta0"].items():
        if key.endswith("bias"):
            assert torch.equal(value, init.state_dict()[key])
    for name, mask in payload["masks"].items():  # survivors at their initial value, pruned ones 0
        assert torch.equal(payload["theta0"][name], init.weights()[name].detach() * mask), name
    eps_so_far = [r["epsilon_so_far"] for r in payload["private_ticket"]["rounds"]]
    assert eps_so_far == sorted(eps_so_far) and eps_so_far[-1] < 3.0


def test_a_private_ticket_is_refused_on_other_data_of_the_same_name(tiny_splits: DatasetSplits,
                                                                    tmp_path: Path) -> None:
    cfg = _config()
    made_on = dataclasses.replace(tiny_splits, seed=1, val_fraction=0.1)
    make_private_ticket(cfg, made_on, tmp_path / "t.pt", progress=False, noise_seed=1)
    assert load_winner(tmp_path / "t.pt").source_data["fingerprint"] is None  # user data: not recorded
    # so the data settings and counts tell other data apart
    fewer = LabeledTensors(made_on.train.features[:-1], made_on.train.labels[:-1])
    for other, says in ((dataclasses.replace(made_on, source_split="all"), "split train in the file, all in the data"),
                        (dataclasses.replace(made_on, train=fewer), "n_train 512 in the file, 511 in the data"),
                        (dataclasses.replace(made_on, seed=2), "seed 1 in the file, 2 in the data")):
        with pytest.raises(DpltmUserError, match="same dataset, split, seed") as refused:
            train(cfg, other, tmp_path / "m.pt", ticket=load_winner(tmp_path / "t.pt"), ticket_path=tmp_path / "t.pt",
                  private=True, progress=False)
        assert says in str(refused.value)


def test_plan_refuses_what_it_cannot_account(tiny_splits: DatasetSplits) -> None:
    base = _config()
    for change, message in [({"sigma": 1.0, "eps2": None}, "not --sigma"),
                            ({"noise": "shaped"}, "shaped"),
                            ({"batch_size": 600}, "smaller than the training set")]:
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, **change))
        with pytest.raises(DpltmUserError, match=message):
            plan_private_ticket(cfg, len(tiny_splits.train))


def test_generate_private_flags_are_checked(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpltm.cli import main

    for argv, message in [(["generate", "--private", "--iterations", "5"],
                           "--iterations belongs to non-private IMP: drop it with --private"),
                          (["generate", "--private", "--iterations", "5", "--min-density", "0.1"],
                           "belong to non-private IMP: drop them with --private"),
                          (["generate", "--eps", "1"], "--eps only applies with --private"),
                          (["generate", "--private", "--density", "1.5"], "--density must lie in (0, 1)")]:
        monkeypatch.setattr(sys, "argv", ["dpltm", *argv])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_generate_private_warns_of_a_delta_above_one_over_n(tmp_path: Path, capsys: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """As train and make_private do: δ > 1/N allows releasing a record outright."""
    from dpltm.cli import main
    from tests.datafiles import write_digits

    write_digits(tmp_path / "data")
    monkeypatch.setenv("DPLTM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(sys, "argv", ["dpltm", "generate", "--private", "--dataset", "digits", "--eps", "1", "--delta",
                                      "0.01", "--epochs", "2", "--warmup-epochs", "1", "--device", "cpu",
                                      "--no-progress", "--out", str(tmp_path / "t.pt")])
    main()
    assert "warning: δ = 0.01 is above 1/N" in " ".join(capsys.readouterr().err.split())


def test_ledger_of_a_private_ticket_round_trips_and_needs_its_warmup() -> None:
    from dpltm.privacy.ledger import training_record

    warmup = training_record(0.01, 2.0, 100, 1.0, 500, 50000)
    training = training_record(0.01, 2.0, 400, 1.0, 500, 50000)
    ledger = PrivacyLedger(phase1="private", phase1_dataset="mnist (train split)", private_dataset="mnist",
                           selection_eps1=None, training=training, delta=1e-5, phase1_training=(warmup,))
    assert ledger.end_to_end_dp and ledger.epsilon_scope == "whole run"
    assert PrivacyLedger.from_json(ledger.to_json()) == ledger
    # the same events as one run of 500 steps: the composition is exact, not a sum of two ε
    single = PrivacyLedger(phase1="none", phase1_dataset=None, private_dataset="mnist", selection_eps1=None,
                           training=training_record(0.01, 2.0, 500, 1.0, 500, 50000), delta=1e-5)
    assert ledger.best_bound().epsilon == pytest.approx(single.best_bound().epsilon, rel=1e-6)
    with pytest.raises(DpltmUserError, match="warm-up rounds"):
        PrivacyLedger(phase1="private", phase1_dataset="mnist", private_dataset="mnist", selection_eps1=None,
                      training=training, delta=1e-5)
    with pytest.raises(DpltmUserError, match="warm-up rounds"):
        PrivacyLedger(phase1="public", phase1_dataset="kmnist", private_dataset="mnist", selection_eps1=None,
                      training=training, delta=1e-5, phase1_training=(warmup,))
    tampered = ledger.to_json()
    tampered["phase1_training"][0]["sigma"] = 4.0  # the stored DpEvent no longer matches
    with pytest.raises(DpltmUserError, match="inconsistent"):
        PrivacyLedger.from_json(tampered)


def test_lr_sigma_sets_a_dp_runs_learning_rate_from_its_sigma(tiny_splits: DatasetSplits) -> None:
    from dpltm.training.plan import plan_training

    settings = TrainSettings(epochs=2, batch_size=64, eps2=1.0, lr=0.1, lr_sigma=3.0)
    plan = plan_training(settings, len(tiny_splits.train))
    assert plan.lr == pytest.approx(3.0 / plan.noise_multiplier)
    assert plan_training(dataclasses.replace(settings, lr_sigma=None), len(tiny_splits.train)).lr == 0.1
    with pytest.raises(DpltmUserError, match="--lr-sigma"):
        TrainSettings(lr_sigma=-1.0)


def test_select_refuses_a_private_ticket_saying_what_to_do(tiny_splits: DatasetSplits, tmp_path: Path,
                                                          capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpltm.cli import main

    make_private_ticket(_config(), tiny_splits, tmp_path / "t.pt", progress=False, noise_seed=1)
    monkeypatch.setattr(sys, "argv", ["dpltm", "select", "--tickets", str(tmp_path / "t.pt"), "--best"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "needs no selection; train it with `dpltm train --ticket" in capsys.readouterr().err


def test_training_a_private_ticket_defaults_to_its_plan_under_config_and_flags(tiny_splits: DatasetSplits,
                                                                               tmp_path: Path) -> None:
    from dpltm.config import resolve_train_config
    from dpltm.tickets.private import private_ticket_plan

    cfg = dataclasses.replace(_config(eps=1.5, epochs=4), model=dataclasses.replace(_config().model,
                                                                                   activation="tanh"))
    make_private_ticket(cfg, tiny_splits, tmp_path / "t.pt", progress=False, noise_seed=1)
    plan = private_ticket_plan(load_winner(tmp_path / "t.pt"))
    resolved = resolve_train_config({"data": {"dataset": "blobs"}}, None, base=plan)
    assert (resolved.train.eps2, resolved.train.epochs, resolved.train.batch_size, resolved.model.activation) == (
        1.5, 4, 64, "tanh")
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  eps2: 0.5\n")  # the user's config file outranks the ticket's plan
    assert resolve_train_config({"data": {"dataset": "blobs"}}, config, base=plan).train.eps2 == 0.5
    flags = resolve_train_config({"data": {"dataset": "blobs"}, "train": {"epochs": 7}}, config, base=plan)
    assert flags.train.epochs == 7


def test_phases_never_share_randomness_and_warmup_cannot_stop_early(tiny_splits: DatasetSplits) -> None:
    from dpltm.tickets.private import phase_seed

    seeds = {phase_seed(5, "warm-up 0"), phase_seed(5, "warm-up 1"), 5, 6}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    for change in ({"patience": 2}, {"max_eps": 0.5}):
        cfg = dataclasses.replace(_config(), train=dataclasses.replace(_config().train, **change))
        with pytest.raises(DpltmUserError, match="patience"):
            plan_private_ticket(cfg, len(tiny_splits.train))


def _images(n: int, seed: int) -> LabeledTensors:
    """28×28 records of 3 classes, each class a brighter quadrant: what LeNet-5 takes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    images = torch.rand(n, 28, 28, generator=g) * 0.3
    for k in range(3):
        images[labels == k, (k // 2) * 14:(k // 2) * 14 + 14, (k % 2) * 14:(k % 2) * 14 + 14] += 0.6
    return LabeledTensors(images.reshape(n, 784), labels)


def test_a_cnn_private_ticket_prunes_its_convolutions_and_trains_end_to_end_dp(tmp_path: Path) -> None:
    """`generate --private --arch lenet5`: the DP warm-up and magnitude pruning cover the convolutions too (their
    (out, in, k, k) weights counted whole), and the ticket trains to one guarantee within the requested ε."""
    data = DatasetSplits("images", "train", _images(384, 0), _images(64, 1), _images(64, 2), 784, 3, "fp-images")
    base = _config(eps=2.0, warmup=1, epochs=2, density_=0.4)
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, arch="lenet5", hidden=(16,)),
                              train=dataclasses.replace(base.train, batch_size=32))
    ticket_path = tmp_path / "ticket.pt"
    payload = make_private_ticket(cfg, data, ticket_path, progress=False, noise_seed=1).to_dict()
    assert payload["architecture"]["conv"] and payload["density"] == pytest.approx(0.4, abs=0.02)
    assert {"conv.0.weight", "conv.1.weight"} <= set(payload["masks"])
    assert all(0.0 < float(payload["masks"][n].float().mean()) < 1.0 for n in ("conv.0.weight", "conv.1.weight"))
    for name, mask in payload["masks"].items():
        assert torch.all(payload["theta0"][name][~mask] == 0)
    report = train(cfg, data, tmp_path / "model.pt", ticket=load_winner(ticket_path), ticket_path=ticket_path,
                   private=True, progress=False, noise_seed=2)
    assert report.end_to_end_dp is True and report.epsilon <= 2.0
    state = load_checkpoint(tmp_path / "model.pt", ("model",))["state_dict"]
    for name, mask in payload["masks"].items():
        assert torch.all(state[name][~mask] == 0)
    with pytest.raises(DpltmUserError, match="--noise dpd shapes the MLP's layers"):
        make_private_ticket(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, noise="dpd")), data,
                            tmp_path / "t2.pt", progress=False)
    assert not (tmp_path / "t2.pt").exists()


def test_prune_input_features_keeps_the_strongest_columns_whole() -> None:
    """DP feature selection: the columns of largest L2 norm survive whole, inside the old mask, ties by position."""
    weight = torch.tensor([[3.0, 0.1, 1.0, 0.0, 2.0], [0.0, 0.1, 1.0, 0.0, 0.0]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, 4] = False  # an already pruned column never returns, however large its weights
    new = prune_input_features(weight, mask, 0.5)  # ⌈0.5 · 4 surviving⌉ = 2 columns
    assert new.tolist() == [[True, False, True, False, False]] * 2
    assert prune_input_features(torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool), 0.5)[:, :2].all()  # ties
    assert prune_input_features(weight, mask, 1e-6).any(dim=0).sum() == 1  # at least one feature
    with pytest.raises(DpltmUserError, match="convolution"):
        prune_input_features(torch.ones(2, 1, 3, 3), torch.ones(2, 1, 3, 3, dtype=torch.bool), 0.5)


def test_an_input_feature_ticket_prunes_whole_inputs_and_composes_its_warm_up(tiny_splits: DatasetSplits,
                                                                              tmp_path: Path) -> None:
    """`--prune inputs`: the first layer keeps `density` of its input features whole, by the DP warm-up weights
    (post-processing: the ledger holds the warm-up and training, and its ε is an independent PLD's over both); the
    pruned inputs stay exactly zero through DP training."""
    base = _config(eps=2.0, warmup=2, epochs=2, rounds=2, density_=0.3)
    cfg = dataclasses.replace(base, private_ticket=dataclasses.replace(base.private_ticket, prune="inputs"))
    ticket_path = tmp_path / "ticket.pt"
    payload = make_private_ticket(cfg, tiny_splits, ticket_path, progress=False, noise_seed=1).to_dict()
    first, *others = payload["masks"]
    columns = payload["masks"][first].any(dim=0)
    assert int(columns.sum()) == math.ceil(0.3 ** 0.5 * math.ceil(0.3 ** 0.5 * tiny_splits.num_features - 1e-9)
                                           - 1e-9)
    assert torch.equal(payload["masks"][first], columns.expand_as(payload["masks"][first]))  # whole columns
    assert all(payload["masks"][name].all() for name in others)
    report = train(cfg, tiny_splits, tmp_path / "model.pt", ticket=load_winner(ticket_path), ticket_path=ticket_path,
                   private=True, progress=False, noise_seed=2)
    body = load_checkpoint(tmp_path / "model.pt", ("model",))
    ledger = PrivacyLedger.from_json(body["privacy"]["ledger"])
    phases = [(w["q"], w["sigma"], w["steps"]) for w in ledger.phase1_training]
    phases.append((ledger.training["q"], ledger.training["sigma"], ledger.training["steps"]))
    assert len(phases) == 3
    independent = _independent_pld_epsilon(phases, 1e-5)
    assert report.epsilon == pytest.approx(independent, rel=1e-9) and independent <= 2.0
    assert torch.all(body["state_dict"][first][:, ~columns] == 0)


def test_prune_inputs_is_refused_for_a_convolution_before_any_record_is_read() -> None:
    arch = build_architecture(784, 10, (16,), None, "relu", "lenet5")
    with pytest.raises(DpltmUserError, match="--prune inputs keeps whole input features"):
        check_private_prune(arch, PrivateTicketSettings(prune="inputs"))
    with pytest.raises(DpltmUserError, match="--prune must be one of weights, inputs"):
        PrivateTicketSettings(prune="columns")
