"""The noise-aware choice searching more than the ticket (issue 21, item 3): each ticket from both starts,
with its first layer frozen at its public weights, and scored by both releases (final iterate, EMA with
warm-up); the dense network as planned stays the reference a variant must beat by two standard errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dpltm.artefacts import TicketSet
from dpltm.data.types import DatasetSplits
from dpltm.errors import DpltmUserError
from dpltm.options import Overrides
from dpltm.selection.noise_aware import (
    SEARCHED_EMA,
    EachCandidate,
    PlannedRun,
    Variant,
    noise_aware_choice,
    searched_releases,
    searched_trainings,
)
from dpltm.selection.winner import chosen_training, noise_aware_selection
from dpltm.settings import DataSettings, GenerateConfig, GenerateSettings, ModelSettings, check_search
from dpltm.tickets.imp import generate_tickets


def _tickets(splits: DatasetSplits, path: Path, hidden: tuple[int, ...]) -> TicketSet:
    cfg = GenerateConfig(data=DataSettings(dataset="blobs"), model=ModelSettings(hidden=hidden),
                         generate=GenerateSettings(rounds=2, iterations=40, batch_size=32, prune_rates=(0.6,)))
    return generate_tickets(cfg, splits, path, progress=False)


@pytest.fixture
def tickets(tiny_splits: DatasetSplits, tmp_path: Path) -> TicketSet:
    return _tickets(tiny_splits, tmp_path / "t.pt", (16,))


PLAN = PlannedRun(noise_multiplier=1.0, expected_batch_size=64, steps=6, clip=1.0, lr=0.3)


def test_the_search_space_puts_the_plan_first_and_toggles_one_thing_at_a_time() -> None:
    assert searched_trainings(PLAN, (), "hidden.0") == [("init", ())]
    assert searched_trainings(PLAN, ("start", "freeze"), "hidden.0") == [
        ("init", ()), ("public", ()), ("public", ("hidden.0",))]
    frozen = replace(PLAN, start="public", freeze=("hidden.0",))
    assert searched_trainings(frozen, ("start", "freeze"), "hidden.0") == [
        ("public", ("hidden.0",)), ("init", ("hidden.0",)), ("public", ())]
    assert searched_trainings(PLAN, ("freeze",), None) == [("init", ())]  # a one-layer network: nothing to freeze
    assert searched_trainings(PLAN, ("freeze",), "hidden.0") == [("init", ())]  # start fixed at θ0: no random layer
    public = replace(PLAN, start="public")
    assert searched_trainings(public, ("freeze",), "hidden.0") == [("public", ()), ("public", ("hidden.0",))]
    assert searched_releases(PLAN, ("release",)) == [(None, False), (SEARCHED_EMA, True)]
    averaging = replace(PLAN, ema=0.99, ema_warmup=False)
    assert searched_releases(averaging, ("release",)) == [(0.99, False), (None, False)]
    assert searched_releases(averaging, ("start",)) == [(0.99, False)]


@pytest.mark.parametrize("bad", ["start", ["start", "everything"], [1], None])
def test_an_unknown_search_is_one_line(bad: object) -> None:
    with pytest.raises(DpltmUserError, match="--search"):
        check_search(bad)
    assert check_search(["release", "start", "start"]) == ("start", "release")


def test_every_ticket_is_a_candidate_under_each_start_and_release(tickets: TicketSet,
                                                                  tiny_splits: DatasetSplits) -> None:
    plain = noise_aware_choice(tickets, tiny_splits, PLAN, seed=0)
    assert len(plain.candidates) == len(tickets.tickets) == 3 and plain.chosen is None and plain.searched == ()
    choice = noise_aware_choice(tickets, tiny_splits, PLAN, seed=0, search=("release", "start"))
    assert choice.searched == ("start", "release")
    rows = [(c.round, c.start, c.ema) for c in choice.candidates]
    assert rows == [(t.round, start, ema) for t in tickets.tickets for start in ("init", "public")
                    for ema in (None, SEARCHED_EMA)]
    assert all(c.ema_warmup == (c.ema is not None) and c.steps == PLAN.steps for c in choice.candidates)
    reference = choice.candidates[0]
    assert (reference.density, reference.start, reference.ema, reference.gain_over_dense) == (1.0, "init", None, 0.0)
    assert isinstance(choice.chosen, Variant)  # recorded even when the plan itself wins
    # the winner file's per-ticket scores: each ticket's best variant
    scores = noise_aware_selection(choice).scores
    assert scores.tolist() == [max(c.public_val_accuracy for c in choice.candidates if c.round == t.round)
                               for t in tickets.tickets]


def test_a_variant_that_clearly_beats_the_plan_wins_and_is_what_train_runs(tickets: TicketSet,
                                                                          tiny_splits: DatasetSplits) -> None:
    """One tiny step from θ0 leaves a network near chance; the public-trained weights (their own output layer:
    the same four classes) are already accurate. Searching the start must take them, and say so; without the
    search the plan (θ0) is all there is."""
    plan = replace(PLAN, steps=1, lr=1e-4, output_layer="keep")
    choice = noise_aware_choice(tickets, tiny_splits, plan, seed=1, search=("start",))
    assert choice.chosen is not None and choice.chosen.start == "public"
    best = max(choice.candidates, key=lambda c: c.public_val_accuracy)
    assert best.start == "public" and best.gain_over_dense > 2 * best.gain_standard_error
    assert choice.candidates[choice.index * 2].round == tickets.tickets[choice.index].round
    selection = {"noise_aware": json.loads(json.dumps(choice.to_json()))}  # as the winner file holds it
    assert chosen_training(selection) == Overrides({"train.rewind": "public", "train.output_layer": "keep"})  # searched
    assert noise_aware_choice(tickets, tiny_splits, plan, seed=1).chosen is None


def test_a_public_start_identical_to_theta0_is_not_trained_twice(tiny_splits: DatasetSplits, tmp_path: Path) -> None:
    """A linear network's only layer is its output layer, re-initialised at θ0 under a public start: that
    start trains exactly as θ0 does, so it is no candidate of its own (and there is no layer to freeze)."""
    linear = _tickets(tiny_splits, tmp_path / "linear.pt", ())
    choice = noise_aware_choice(linear, tiny_splits, PLAN, seed=0, search=("start", "release", "freeze"))
    assert {c.start for c in choice.candidates} == {"init"} and {c.freeze for c in choice.candidates} == {()}
    assert len(choice.candidates) == 2 * len(linear.tickets)  # both releases of each ticket


def test_the_frozen_variant_holds_the_first_layer_at_its_public_weights(tickets: TicketSet,
                                                                        tiny_splits: DatasetSplits,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[EachCandidate] = []
    real = EachCandidate.__init__

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(EachCandidate, "__init__", recording)
    choice = noise_aware_choice(tickets, tiny_splits, replace(PLAN, start="public"), seed=0, search=("freeze",))
    assert len(made) == 1  # a frozen layer: every candidate by the private step itself, not stacked
    frozen = [k for k, c in enumerate(choice.candidates) if c.freeze]
    assert frozen and all(choice.candidates[k].start == "public" for k in frozen)
    for k in frozen:
        ticket = next(t for t in tickets.tickets if t.round == choice.candidates[k].round)
        mask = ticket.masks["hidden.0.weight"]
        state = made[0].models[k].state_dict()
        assert torch.equal(state["hidden.0.weight"], (ticket.trained or {})["hidden.0.weight"] * mask)
        assert not torch.equal(state["output.weight"], tickets.theta0["output.weight"])  # the rest trained


def test_halving_over_variants_drops_whole_networks_and_keeps_the_reference(tickets: TicketSet,
                                                                            tiny_splits: DatasetSplits) -> None:
    choice = noise_aware_choice(tickets, tiny_splits, replace(PLAN, steps=8), seed=2, halving=1,
                                search=("start", "release"))
    by_network: dict[tuple[int, str], set[int]] = {}
    for c in choice.candidates:
        by_network.setdefault((c.round, c.start or ""), set()).add(c.steps)
    assert all(len(steps) == 1 for steps in by_network.values())  # both releases of a network stop together
    assert by_network[(0, "init")] == {8}  # the reference always goes on
    # 6 networks: the reference and the better half of the other 5 (3) go on after T/2
    assert sorted(min(steps) for steps in by_network.values()) == [4, 4, 8, 8, 8, 8]
    chosen = choice.chosen
    assert chosen is not None
    winner = next(c for c in choice.candidates if c.round == tickets.tickets[choice.index].round
                  and c.start == chosen.start and c.ema == chosen.ema)
    assert winner.steps == 8


GOOD = {"start": "public", "freeze": ["hidden.0"], "ema": 0.999, "ema_warmup": True, "output_layer": "reinit"}


def test_train_takes_only_the_dimensions_the_choice_searched() -> None:
    def body(searched: list[str], chosen: object = GOOD) -> dict:  # type: ignore[type-arg]
        return {"noise_aware": {"searched": searched, "chosen": chosen}}  # a winner's selection record

    assert chosen_training(body(["release"])) == Overrides({"train.ema": 0.999, "train.ema_warmup": True})
    assert chosen_training(body(["freeze"])) == Overrides({"train.rewind": "public", "train.output_layer": "reinit",
                                                           "train.freeze": ["hidden.0"]})
    assert chosen_training(body([], None)) is None and chosen_training(None) is None
    assert chosen_training({"noise_aware": None}) is None


@pytest.mark.parametrize("damage", [
    {"ema": "0.9"}, {"ema": 2.0}, {"ema": True}, {"start": None}, {"start": "warmup"}, {"freeze": "hidden.0"},
    {"freeze": [1]}, {"freeze": [""]}, {"ema": None, "ema_warmup": True}, {"ema_warmup": "yes"},
    {"output_layer": "new"}, {"extra": 1}])
def test_a_damaged_chosen_variant_is_one_line(damage: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(DpltmUserError, match="chosen variant"):
        chosen_training({"noise_aware": {"searched": ["start"], "chosen": {**GOOD, **damage}}})
    for searched in ([], ["everything"], "start"):
        with pytest.raises(DpltmUserError, match="chosen variant"):
            chosen_training({"noise_aware": {"searched": searched, "chosen": GOOD}})
