"""The stronger recipe (issue 9, part 3): SGD momentum on the privatized gradients, an EMA of the
DP iterates that is evaluated and released, and the activation option, on one code path for
tickets and the dense / non-private baselines."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import dpltm.dp.step as dp_step
from dpltm.artefacts import Winner
from dpltm.data.types import DatasetSplits
from dpltm.dp.mechanism import NoiseContext
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.settings import TrainSettings
from dpltm.training.plain import accuracy, train_classifier
from dpltm.training.plan import plan_training
from dpltm.training.private import TrainOutcome, make_optimizer, run_non_private, run_private
from dpltm.training.transfer import model_from_ticket

Params = dict[str, torch.Tensor]


def pruned_model(activation: str = "relu", rounds: int = 2) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(20, 4, (16, 8), None, activation), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model, masks


def params_of(model: LeNet) -> Params:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def dp_run(data: DatasetSplits, monkeypatch: pytest.MonkeyPatch, **recipe: Any
           ) -> tuple[TrainOutcome, LeNet, Masks, Params, list[Params], list[Params]]:
    """A short DP run of a pruned ticket with a fixed noise seed; returns what dpltm released, the
    trained model and its masks, θ0, every iterate θ_1..θ_T and every privatized gradient ĝ_1..ĝ_T
    (recorded as they are applied)."""
    settings = TrainSettings(epochs=2, batch_size=64, eps2=None, sigma=1.0, lr=0.2, **recipe)
    plan = plan_training(settings, len(data.train))
    model, masks = pruned_model()
    theta0 = params_of(model)
    iterates: list[Params] = []
    grads: list[Params] = []
    apply = dp_step.apply_gradients

    def recording(model_: LeNet, grads_: Params, optimizer: torch.optim.Optimizer, **hooks: Any) -> None:
        grads.append({k: v.detach().clone() for k, v in grads_.items()})
        apply(model_, grads_, optimizer, **hooks)
        iterates.append(params_of(model_))

    monkeypatch.setattr(dp_step, "apply_gradients", recording)
    outcome = run_private(model, data, plan, settings, seed=7, epsilon_after=lambda steps: 0.0, progress=False,
                          noise_context=NoiseContext(model=model, masks=masks, clip=settings.clip,
                                                     private_dataset=data.name))
    monkeypatch.undo()
    assert len(iterates) == plan.steps
    return outcome, model, masks, theta0, iterates, grads


def hand_ema(iterates: list[Params], decay: float) -> Params:
    """EMA_1 = θ_1, EMA_t = decay·EMA_{t-1} + (1 − decay)·θ_t, in float64."""
    ema = {k: v.double() for k, v in iterates[0].items()}
    for theta in iterates[1:]:
        ema = {k: decay * ema[k] + (1 - decay) * theta[k].double() for k in ema}
    return ema


def test_ema_weights_are_a_function_of_the_dp_iterates_only(tiny_splits: DatasetSplits,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    plain, plain_model, _, _, plain_iterates, _ = dp_run(tiny_splits, monkeypatch, momentum=0.5)
    outcome, model, masks, _, iterates, _ = dp_run(tiny_splits, monkeypatch, momentum=0.5, ema=0.9)
    # the average never feeds back: the same noise seed gives the same iterates with or without it
    for a, b in zip(plain_iterates, iterates):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert plain.released is plain_model and plain.released_weights == "final iterate"
    released = outcome.released
    assert released is not None and released is not model and outcome.released_weights == "ema(0.9)"
    # what dpltm released is the EMA recomputed by hand from the recorded iterates, nothing else
    expected = hand_ema(iterates, 0.9)
    for name, value in released.named_parameters():
        torch.testing.assert_close(value.detach().double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # the ticket's masks (beside the model) hold for the average as they are: pruned coordinates are
    # exactly 0 in every iterate, so in their average too
    for name, mask in masks.items():
        assert not bool(mask.all())  # the ticket is pruned: the checks below bite
        key = name
        assert all(torch.count_nonzero(theta[key][~mask]) == 0 for theta in iterates), name
        assert torch.count_nonzero(released.weights()[name][~mask]) == 0, name
    released_state = released.state_dict()
    assert set(released_state) == set(model.state_dict())  # a LeNet checkpoint, same keys
    assert not any(k.startswith("mask") for k in released_state)  # the average holds no masks
    # the reported accuracies are the released weights'
    assert outcome.history[-1]["val_accuracy"] == pytest.approx(accuracy(released, tiny_splits.val))
    assert outcome.history[-1]["test_accuracy"] == pytest.approx(accuracy(released, tiny_splits.test))


def test_momentum_acts_on_the_privatized_gradients(tiny_splits: DatasetSplits,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """θ_{t+1} = θ_t − lr·v_{t+1}, v_{t+1} = μ·v_t + ĝ_t: the optimiser sees only ĝ (post-processing)."""
    _, _, _, theta0, iterates, grads = dp_run(tiny_splits, monkeypatch, momentum=0.5)
    theta = {k: v.double() for k, v in theta0.items()}
    velocity = {k: torch.zeros_like(v) for k, v in theta.items()}
    for step, (g, recorded) in enumerate(zip(grads, iterates)):
        for name in theta:
            velocity[name] = 0.5 * velocity[name] + g[name].double() if step else g[name].double()
            theta[name] = theta[name] - 0.2 * velocity[name]
            torch.testing.assert_close(recorded[name].double(), theta[name], rtol=1e-4, atol=1e-5)
    optimizer = make_optimizer(TrainSettings(momentum=0.9), pruned_model()[0].parameters())
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["momentum"] == 0.9
    assert make_optimizer(TrainSettings(), pruned_model()[0].parameters()).param_groups[0]["momentum"] == 0.0


def test_non_private_baseline_default_is_unchanged(tiny_splits: DatasetSplits) -> None:
    """Momentum 0 and no EMA reproduce the earlier baseline (plain SGD, one reshuffle per epoch)."""
    settings = TrainSettings(epochs=2, batch_size=64, lr=0.3)
    (model, masks), (reference, reference_masks) = pruned_model(), pruned_model()
    outcome = run_non_private(model, tiny_splits, settings, seed=3, progress=False, masks=masks)
    steps = math.ceil(len(tiny_splits.train) / settings.batch_size)
    for epoch in (1, 2):  # the loop run_non_private replaced
        train_classifier(reference, tiny_splits.train, masks=reference_masks, steps=steps, batch_size=64, lr=0.3,
                         seed=3 * 100_003 + epoch)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    assert outcome.released is model and outcome.released_weights == "final iterate"
    assert [r["epoch"] for r in outcome.history] == [1, 2] and outcome.steps == 2 * steps
    assert outcome.history[-1]["val_accuracy"] == pytest.approx(accuracy(model, tiny_splits.val))


def test_non_private_baseline_takes_the_same_recipe(tiny_splits: DatasetSplits) -> None:
    settings = TrainSettings(epochs=2, batch_size=64, lr=0.3, momentum=0.9, ema=0.95)
    model, masks = pruned_model("tanh")
    outcome = run_non_private(model, tiny_splits, settings, seed=0, progress=False, masks=masks)
    released = outcome.released
    assert released is not None and released is not model and outcome.released_weights == "ema(0.95)"
    assert released.arch.activation == "tanh"
    for name, mask in masks.items():  # the ticket holds for the trained model and for its average
        assert not bool(mask.all())
        assert torch.count_nonzero(model.weights()[name][~mask]) == 0, name
        assert torch.count_nonzero(released.weights()[name][~mask]) == 0, name
    assert any(not torch.equal(a, b) for a, b in zip(released.parameters(), model.parameters()))
    assert outcome.history[-1]["val_accuracy"] == pytest.approx(accuracy(released, tiny_splits.val))
    assert outcome.history[-1]["val_accuracy"] > 0.5  # it learned


def ticket_of(model: LeNet, masks: Masks, method: str = "best") -> Winner:
    """The fields of a winner that building its network reads."""
    return Winner(architecture=model.arch.to_dict(), theta0=dict(model.state_dict()), masks=masks, density=1.0,
                  layer_density={}, round=0, val_accuracy=0.0, privacy={}, selection={"method": method},
                  source={"tickets": None, "data": {"dataset": "digits", "split": "train"}})


def test_a_tickets_activation_can_be_overridden(tiny_splits: DatasetSplits) -> None:
    source, source_masks = pruned_model("relu")
    ticket = ticket_of(source, source_masks)
    same, same_masks, record = model_from_ticket(ticket, 20, 4, seed=0)
    assert same.arch.activation == "relu"
    assert record.to_dict() == {"mode": "direct", "kept_layers": same.arch.layer_names(), "activation": "relu",
                                "rewind": "init"}
    model, masks, record = model_from_ticket(ticket, 20, 4, seed=0, activation="tanh")
    assert model.arch.activation == "tanh"
    assert record.activation_override == {"ticket": "relu", "used": "tanh"}
    for name, value in source.state_dict().items():  # masks and θ0 carry over unchanged
        assert torch.equal(model.state_dict()[name], value), name
    assert masks.keys() == source_masks.keys() == same_masks.keys()
    for name, mask in source_masks.items():
        assert torch.equal(masks[name], mask) and torch.equal(same_masks[name], mask), name
    x = tiny_splits.val.features[:5]
    assert not torch.allclose(model(x), same(x))  # it is another network
    # cross-architecture transfer (other classes): hidden masks and θ0 kept, activation as asked
    cross, cross_masks, record = model_from_ticket(ticket, 20, 3, seed=0, activation="tanh")
    assert record.mode == "cross-architecture" and cross.arch.activation == "tanh"
    assert record.activation_override == {"ticket": "relu", "used": "tanh"}
    assert torch.equal(cross_masks["hidden.0.weight"], source_masks["hidden.0.weight"])
    assert torch.count_nonzero(cross.weights()["hidden.0.weight"][~source_masks["hidden.0.weight"]]) == 0


def test_the_tuned_recipe_layers_under_the_config_file_and_flags(tmp_path: Any) -> None:
    from dpltm.config import resolve_train_config
    from dpltm.stages.run import chosen_recipe

    tuned = resolve_train_config({"recipe": "tuned"}, None)
    assert (tuned.model.activation, tuned.train.batch_size, tuned.train.lr_sigma, tuned.train.ema) == (
        "tanh", 1600, 6.0, 0.999)
    assert resolve_train_config({}, None).train.lr_sigma is None  # the paper's defaults are untouched
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  batch_size: 800\n")
    both = resolve_train_config({"recipe": "tuned", "train": {"ema": 0.99}}, config)
    assert (both.train.batch_size, both.train.ema, both.train.lr_sigma) == (800, 0.99, 6.0)
    assert chosen_recipe("auto", 54000) == "tuned" and chosen_recipe("auto", 1336) == "paper"
    assert chosen_recipe("paper", 54000) == "paper"
    assert chosen_recipe("auto", 54000, scatter=True) == "scatter" and chosen_recipe("auto", 1336, True) == "paper"
    scatter = resolve_train_config({"recipe": "scatter"}, None)
    assert (scatter.model.arch, scatter.train.batch_size, scatter.train.lr_sigma, scatter.train.momentum) == (
        "scatter-linear", 4096, 1.0, 0.9)
    with pytest.raises(DpltmUserError, match="--recipe scatter is for the ScatterNet heads"):
        resolve_train_config({"recipe": "scatter", "model": {"arch": "mlp"}}, None)  # would lose its hidden layers
    assert resolve_train_config({"recipe": "scatter", "model": {"arch": "scatter-mlp", "hidden": [100]}},
                                None).model.hidden == (100,)
    cnn = resolve_train_config({"recipe": "cnn"}, None)  # LeNet-5's: the tuned rate, the final iterate
    assert (cnn.model.arch, cnn.model.hidden, cnn.train.batch_size, cnn.train.lr_sigma, cnn.train.ema) == (
        "lenet5", (120, 84), 1600, 6.0, None)
    with pytest.raises(DpltmUserError, match="--recipe cnn is LeNet-5's"):
        resolve_train_config({"recipe": "cnn", "model": {"arch": "mlp"}}, None)
    with pytest.raises(DpltmUserError, match="--recipe cnn was chosen on kmnist's test split"):
        resolve_train_config({"recipe": "cnn", "data": {"dataset": "kmnist", "split": "test"}}, None)
    assert chosen_recipe("auto", 54000, arch="lenet5") == "cnn"
    assert chosen_recipe("auto", 1336, arch="lenet5") == "paper"
    assert chosen_recipe("auto", 54000, scatter=True, arch="scatter-cnn") == "scatter"


def test_run_takes_the_scatter_front_end_where_it_applies() -> None:
    """`run --recipe auto`: the ScatterNet front end for square images of a side it takes with public tickets of
    the same shape and no other --arch; otherwise the recipes it had."""
    from dpltm.stages.run import RunRequest, generation_settings, scatter_applies

    assert scatter_applies(None, 784, 784) and scatter_applies("scatter-cnn", 784, 784)
    assert not scatter_applies("mlp", 784, 784) and not scatter_applies("lenet5", 784, 784)
    assert not scatter_applies(None, 64, 784)  # tickets do not transfer across input sizes
    assert not scatter_applies(None, 561, 561) and not scatter_applies(None, 900, 900)  # not square; 30 % 4
    settings = generation_settings(RunRequest(), "scatter", None)
    assert settings.get("model.arch") == "scatter-linear" and settings.get("model.hidden") == []
    assert (settings.get("generate.rounds"), settings.get("generate.iterations")) == (0, 1000)  # the dense head alone
    given = generation_settings(RunRequest(arch="scatter-mlp", rounds=2), "scatter", None)
    assert given.get("model.hidden") == [100] and given.get("generate.rounds") == 2
    assert generation_settings(RunRequest(), "tuned", None).get("model.arch") is None


def test_a_config_file_lies_above_the_recipe_for_the_tickets(tmp_path: Path) -> None:
    """`run --config F`: F's `generate.rounds` and `generate.iterations` make the public tickets, over the recipe's
    (the dense head alone under scatter); a flag over both. The recipe's network stays the tickets'."""
    from dpltm.stages.run import RunRequest, generation_config, generation_settings

    config = tmp_path / "c.yaml"
    config.write_text("generate:\n  rounds: 2\n  iterations: 300\n")
    made = generation_config(generation_settings(RunRequest(config=config), "scatter", None), config).generate
    assert (made.rounds, made.iterations) == (2, 300)
    flagged = generation_config(generation_settings(RunRequest(config=config, rounds=3), "scatter", None), config)
    assert (flagged.generate.rounds, flagged.generate.iterations) == (3, 300)
    assert generation_config(generation_settings(RunRequest(), "scatter", None), None).generate.rounds == 0
    lenet = tmp_path / "lenet.yaml"  # a network in the file leaves the recipe's, with its built-in widths
    lenet.write_text("model:\n  arch: lenet5\n")
    made = generation_config(generation_settings(RunRequest(config=lenet), "cnn", None), lenet).model
    assert (made.arch, tuple(made.hidden)) == ("lenet5", (120, 84))


def test_a_run_without_an_epsilon_curve_computes_none(tiny_splits: DatasetSplits) -> None:
    """The ranks other than 0 of a multi-device run pass no `epsilon_after`: no accountant runs for them and
    their epoch records carry no ε (rank 0's carry it, from the ledger)."""
    import threading

    settings = TrainSettings(epochs=2, batch_size=64, eps2=None, sigma=1.0, lr=0.2)
    plan = plan_training(settings, len(tiny_splits.train))
    model, masks = pruned_model()
    context = NoiseContext(model=model, masks=masks, clip=settings.clip, private_dataset=tiny_splits.name)
    asked: list[int] = []
    with_curve = run_private(model, tiny_splits, plan, settings, seed=1, progress=False, noise_context=context,
                             epsilon_after=lambda steps: asked.append(steps) or 0.5)  # type: ignore[func-returns-value]
    assert sorted(asked) == [plan.steps_per_epoch, 2 * plan.steps_per_epoch]
    assert [r["epsilon"] for r in with_curve.history] == [0.5, 0.5]
    model, masks = pruned_model()
    context = NoiseContext(model=model, masks=masks, clip=settings.clip, private_dataset=tiny_splits.name)
    before = {t.name for t in threading.enumerate()}
    without = run_private(model, tiny_splits, plan, settings, seed=1, progress=False, noise_context=context,
                          epsilon_after=None)
    assert len(without.history) == 2 and all("epsilon" not in r for r in without.history)
    assert not any(t.name.startswith("dpltm-epsilon") for t in threading.enumerate() if t.name not in before)


def test_a_private_ticket_on_data_of_another_size_is_told_where_it_belongs() -> None:
    """A public ticket may be regenerated with --project-to; a private one was made on its own data (no projection):
    the advice names that data and `generate --private`, never --project-to."""
    source, masks = pruned_model()
    public = ticket_of(source, masks)
    with pytest.raises(DpltmUserError, match="--project-to 30"):
        model_from_ticket(public, 30, 4, seed=0)
    private = ticket_of(source, masks, method="private")
    with pytest.raises(DpltmUserError, match=r"made on digits \(20 features\).*generate --private") as error:
        model_from_ticket(private, 30, 4, seed=0)
    assert "--project-to" not in str(error.value)
