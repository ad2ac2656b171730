"""The library's ticket choice defaults to the noise-aware choice, as `dpltm run`'s does: each ticket trained on the
public data as the planned private run will train it, the dense network kept unless a ticket clearly beats it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dpltm
import dpltm.ticket_choice as choice
from dpltm.errors import DpltmUserError

D = 200  # inputs: one informative, 199 noise


def task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, D, generator=g)
    x[:, 0] = 3.0 * (2 * y.float() - 1) + 0.5 * torch.randn(n, generator=g)
    return x, y


def handmade(model: nn.Module) -> list[dpltm.Ticket]:
    """Round 0 dense, round 1 keeping only the informative input, round 2 pruning exactly it."""
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    only, without = torch.zeros(2, D, dtype=torch.bool), torch.ones(2, D, dtype=torch.bool)
    only[:, 0], without[:, 0] = True, False
    full = torch.ones(2, D, dtype=torch.bool)
    return [dpltm.Ticket(k, {"weight": m}, float(m.float().mean()), 0.9, theta0)
            for k, m in enumerate((full, only, without))]


PLANNED = dpltm.PlannedPrivateRun(private_size=2500, epochs=2, batch_size=50, noise_multiplier=3.0, lr=0.5)


def test_a_ticket_that_keeps_the_signal_and_sheds_the_noise_wins_and_one_without_the_signal_never() -> None:
    torch.manual_seed(0)
    model = nn.Linear(D, 2)
    tickets = handmade(model)
    picks = [dpltm.select_ticket(tickets, model=model, public=task(1000, 1), val=task(600, 2), planned=PLANNED,
                                 seed=s).round for s in range(2)]
    assert picks == [1, 1]  # σC/L on 400 weights against on 2: the sparse ticket is clearly better
    assert model.weight.abs().sum() > 0 and torch.equal(model.state_dict()["weight"], tickets[0].theta0["weight"])


def test_the_dense_network_is_kept_unless_a_ticket_clearly_beats_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(D, 2)
    tickets = handmade(model)
    quiet = dpltm.PlannedPrivateRun(private_size=2500, epochs=2, batch_size=50, noise_multiplier=0.3, lr=0.5)
    # little noise: dense and the signal-only ticket both classify (nearly) all right; no clear gain, so dense
    assert dpltm.select_ticket([tickets[0], tickets[2]], model=model, public=task(1000, 1), val=task(600, 2),
                               planned=quiet, seed=0).round == 0
    assert dpltm.select_ticket(tickets[:2], model=model, public=task(1000, 1), val=task(600, 2), planned=quiet,
                               seed=0).round in (0, 1)


def test_the_simulation_runs_the_planned_steps_at_the_planned_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[Any] = []
    real = choice.make_private

    def recording(*args: Any, **kwargs: Any) -> Any:
        runs.append((kwargs, real(*args, **kwargs)))
        return runs[-1][1]

    monkeypatch.setattr(choice, "make_private", recording)
    model = nn.Linear(D, 2)
    dpltm.select_ticket(handmade(model), model=model, public=task(1000, 1), val=task(200, 2), planned=PLANNED, seed=4)
    assert len(runs) == 3
    for kwargs, run in runs:
        assert kwargs["noise_multiplier"] == 3.0 and kwargs["batch_size"] == 50 and kwargs["max_grad_norm"] == 1.0
        assert run.steps_done == 2 * 50  # the planned run's 2 epochs of 2500/50 steps


def test_a_target_epsilon_is_calibrated_as_make_private_calibrates_it() -> None:
    planned = dpltm.PlannedPrivateRun(private_size=5000, epochs=2, batch_size=50, target_epsilon=1.0)
    model = nn.Linear(D, 2)
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), task(5000, 3), target_epsilon=1.0,
                             epochs=2, batch_size=50)
    assert planned.sigma == run.plan.noise_multiplier


@pytest.mark.parametrize(("change", "match"), [
    ({"model": None}, r"^the noise-aware choice .*give model= \(planned=dpltm.PlannedPrivateRun"),
    ({"planned": None, "val": None}, r"give val=, planned="),
    ({"planned": {"epochs": 2}}, "^planned must be a dpltm.PlannedPrivateRun"),
    ({"first": "without"}, "round 0 \\(the dense network\\) first"),
    ({"public": "tiny"}, r"must hold more records than the planned batch \(50\)"),
    ({"eps1": 0.5, "rule": "noise-aware"}, "^eps1 is the exponential mechanism's budget"),
    ({"rule": "paper"}, "^rule must be one of noise-aware, best, exponential"),
])
def test_the_choice_refuses_in_one_line(change: dict[str, Any], match: str) -> None:
    model = nn.Linear(D, 2)
    tickets = handmade(model)
    kwargs: dict[str, Any] = {"model": model, "public": task(1000, 1), "val": task(200, 2), "planned": PLANNED}
    for key, value in change.items():
        if key == "first":
            tickets = [tickets[2], tickets[0]]
        elif key == "public":
            kwargs["public"] = task(40, 1)
        else:
            kwargs[key] = value
    with pytest.raises(DpltmUserError, match=match):
        dpltm.select_ticket(tickets, **kwargs)


@pytest.mark.parametrize(("fields", "match"), [
    ({"batch_size": 5000}, r"must be smaller than private_size"),
    ({"noise_multiplier": None}, "give target_epsilon .* or noise_multiplier"),
    ({"epochs": 0}, "^epochs"),
    ({"optimizer": "adam"}, "^optimizer must be callable"),
])
def test_a_planned_run_that_cannot_run_is_refused_when_made(fields: dict[str, Any], match: str) -> None:
    settings = {"private_size": 5000, "epochs": 2, "batch_size": 50, "noise_multiplier": 1.0, **fields}
    with pytest.raises(DpltmUserError, match=match):
        dpltm.PlannedPrivateRun(**settings)


@pytest.mark.parametrize(("val", "match"), [
    ("labels past the classes", "labels must lie in"), ("nan", "NaN or infinite"), ("column labels", "shape \\(N,\\)"),
    ("empty", "is empty"), ("narrow", "does not accept the features"), ("other model", "not model's")])
def test_the_noise_aware_choice_checks_val_and_the_model_before_training_any_ticket(
        val: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`val` gets evaluate()'s checks, and the tickets must be `model`'s, before the first ticket trains (each
    failure was a silent choice on junk, or a torch traceback after every ticket's simulated training)."""
    torch.manual_seed(0)
    model = nn.Linear(D, 2)
    tickets = handmade(model)
    x, y = task(600, 2)
    bad = {"labels past the classes": (x, y + 5), "nan": (torch.full_like(x, float("nan")), y),
           "column labels": (x, y[:, None]), "empty": (x[:0], y[:0]), "narrow": (x[:, :7], y),
           "other model": (x, y)}[val]

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a ticket was trained before the check")

    monkeypatch.setattr(choice, "_trained_correctness", never)
    given = nn.Sequential(nn.Linear(D, 2)) if val == "other model" else model
    with pytest.raises(DpltmUserError, match=match):
        dpltm.select_ticket(tickets, model=given, public=task(1000, 1), val=bad, planned=PLANNED, seed=0)


def test_the_noise_aware_choice_reads_float64_validation_features_in_the_models_precision() -> None:
    """As evaluate() and generate_tickets read them (NumPy's float64 is the usual case)."""
    torch.manual_seed(0)
    model = nn.Linear(D, 2)
    tickets = handmade(model)
    x, y = task(600, 2)
    quick = dpltm.PlannedPrivateRun(private_size=200, epochs=1, batch_size=50, noise_multiplier=1.0, lr=0.5)
    chosen = dpltm.select_ticket(tickets, model=model, public=task(1000, 1), val=(x.double().numpy(), y.numpy()),
                                 planned=quick, seed=0)
    assert chosen in tickets
