"""The privacy record: DpEvent JSON, end-to-end status, reports and statements."""

from __future__ import annotations

import json
import math
from typing import Any

import dp_accounting as dpa
import pytest

from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import (
    BASIC_COMPOSITION,
    RDP_COMPOSITION,
    TRAINING_ONLY,
    composition_bounds,
    epsilon,
)
from dpltm.privacy.events import dpsgd_event, event_from_json, event_to_json, selection_event
from dpltm.privacy.ledger import PrivacyLedger, round_up, training_record

Q = 400 / 60000
DELTA = 1e-5
TRAINING = training_record(Q, 2.49, 7500, clip=1.0, expected_batch_size=400, dataset_size=60000)


def _ledger(**overrides: Any) -> PrivacyLedger:
    fields: dict[str, Any] = {
        "phase1": "public",
        "phase1_dataset": "kmnist",
        "private_dataset": "mnist",
        "selection_eps1": None,
        "training": TRAINING,
        "delta": DELTA,
    }
    fields.update(overrides)
    return PrivacyLedger(**fields)


def _flatten(event: Any) -> list[Any]:
    """Every event in a tree."""
    out = [event]
    for sub in getattr(event, "events", None) or []:
        out.extend(_flatten(sub))
    inner = getattr(event, "event", None)
    if inner is not None:
        out.extend(_flatten(inner))
    return out


# ---- DpEvent JSON -------------------------------------------------------------------------

EVENTS = [
    dpa.NoOpDpEvent(),
    dpa.NonPrivateDpEvent(),
    dpa.UnsupportedDpEvent(),
    dpa.GaussianDpEvent(1.3),
    dpa.LaplaceDpEvent(0.5),
    dpa.ZCDpEvent(0.01),
    dpa.ZCDpEvent(rho=0.02, xi=0.1),
    dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2.0)),
    dpa.SampledWithoutReplacementDpEvent(60000, 400, dpa.GaussianDpEvent(2.0)),
    dpa.SampledWithReplacementDpEvent(60000, 400, dpa.GaussianDpEvent(2.0)),
    dpa.SelfComposedDpEvent(dpa.LaplaceDpEvent(3.0), 7),
    dpsgd_event(Q, 2.49, 7500),
    selection_event(0.1),
    dpa.ComposedDpEvent(
        [dpa.NonPrivateDpEvent(), selection_event(0.1), dpsgd_event(Q, 2.49, 7500)]
    ),
    dpa.ComposedDpEvent([]),
    dpa.SingleEpochTreeAggregationDpEvent(1.5, [3, 4]),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_json_round_trip(event: Any) -> None:
    data = event_to_json(event)
    assert data["type"] == type(event).__name__
    text = json.dumps(data, allow_nan=False)  # plain, strict JSON
    assert event_from_json(json.loads(text)) == event


def test_event_json_shape() -> None:
    assert event_to_json(dpsgd_event(0.5, 2.0, 3)) == {
        "type": "SelfComposedDpEvent",
        "event": {
            "type": "PoissonSampledDpEvent",
            "sampling_probability": 0.5,
            "event": {"type": "GaussianDpEvent", "noise_multiplier": 2.0},
        },
        "count": 3,
    }
    assert selection_event(0.4) == dpa.ZCDpEvent(rho=0.4**2 / 8)


@pytest.mark.parametrize(
    "data",
    [
        {"noise_multiplier": 1.0},  # no type
        {"type": "os.system"},  # not an event class
        {"type": "DpEvent"},  # the abstract base
        {"type": "GaussianDpEvent"},  # missing field
        {"type": "GaussianDpEvent", "noise_multiplier": 1.0, "extra": 2},
        {"type": "ComposedDpEvent", "events": [{"type": "Bogus"}]},
        ["GaussianDpEvent"],
    ],
)
def test_bad_event_json_raises_user_error(data: Any) -> None:
    with pytest.raises(DpltmUserError):
        event_from_json(data)


# ---- same-data tickets: not end-to-end DP -------------------------------------------------


def test_same_data_ledger_is_not_end_to_end_dp() -> None:
    ledger = _ledger(phase1="same-data", phase1_dataset="mnist", selection_eps1=0.1)
    assert ledger.end_to_end_dp is False
    events = _flatten(ledger.dp_event())
    assert any(isinstance(e, dpa.NonPrivateDpEvent) for e in events)
    assert ledger.overall_epsilon == math.inf
    # dp-accounting agrees: a NonPrivateDpEvent anywhere makes ε infinite.
    assert epsilon(ledger.dp_event(), DELTA, "rdp") == math.inf

    text = ledger.statement()
    assert text.splitlines()[0].startswith("NOT end-to-end differentially private")
    assert "(mnist)" in text.splitlines()[0]
    assert "covers selection and training only (phases 2-3)" in text

    report = ledger.report()
    json.dumps(report, allow_nan=False)
    assert report["end_to_end_dp"] is False
    assert report["overall_epsilon"] == "inf"
    assert "phases 2-3" in report["epsilon_scope"]
    assert "NOT end-to-end" in report["warning"]
    # The ε reported for phases 2-3 is the best composition bound.
    bounds = composition_bounds(0.1, dpsgd_event(Q, 2.49, 7500), DELTA)
    assert report["epsilon"] == min(b.epsilon for b in bounds)
    assert {b["name"] for b in report["bounds"]} == {BASIC_COMPOSITION, RDP_COMPOSITION}


def test_same_data_without_private_selection_records_a_non_private_pick() -> None:
    ledger = _ledger(phase1="same-data", phase1_dataset="mnist")
    assert isinstance(ledger.selection_event(), dpa.NonPrivateDpEvent)
    assert ledger.end_to_end_dp is False


# ---- public tickets: end-to-end DP --------------------------------------------------------


def test_public_ledger_is_end_to_end_dp() -> None:
    ledger = _ledger()
    training_eps = epsilon(dpsgd_event(Q, 2.49, 7500), DELTA, "pld")
    assert ledger.end_to_end_dp is True
    assert ledger.overall_epsilon == training_eps
    assert not any(isinstance(e, dpa.NonPrivateDpEvent) for e in _flatten(ledger.dp_event()))
    # The whole-run event (NoOp phase 1 and selection) gives the same ε.
    assert epsilon(ledger.dp_event(), DELTA, "pld") == pytest.approx(training_eps, rel=1e-9)

    report = ledger.report()
    json.dumps(report, allow_nan=False)
    assert report["epsilon"] == training_eps
    assert report["composition"] == TRAINING_ONLY
    assert report["warning"] is None
    assert report["overall_epsilon"] == training_eps

    text = ledger.statement()
    assert "NOT" not in text
    assert text.startswith("(ε = 0.901, δ = 1e-05)-DP for mnist under add/remove-one adjacency")
    assert "PLD accountant" in text
    assert "public data (kmnist)" in text


def test_the_statement_says_n_is_public_and_what_reads_it() -> None:
    """q = L/N and `--recipe auto`'s threshold read N: the statement says N is treated as public."""
    ledger = PrivacyLedger(phase1="none", phase1_dataset=None, private_dataset="mnist", selection_eps1=None,
                           training=training_record(400 / 54000, 6.80117, 6750, 1.0, 400, 54000), delta=DELTA)
    assert ("Protected: the 54000 training records of mnist (their number N is treated as public: q = L/N, and "
            "settings chosen from N, such as --recipe auto's, depend on it).") in ledger.statement()
    assert "σ = 6.8011," in ledger.statement() and "q = 0.007408," in ledger.statement()


def test_public_tickets_selected_on_a_private_holdout() -> None:
    # docs/privacy.md §2: public tickets scored on private records cost ε1.
    ledger = _ledger(selection_eps1=0.5, accountant="rdp")
    assert ledger.end_to_end_dp is True
    best = ledger.best_bound()
    assert best.name == RDP_COMPOSITION
    assert ledger.overall_epsilon == best.epsilon
    # The stored event tree, read by the RDP accountant, gives exactly that bound.
    assert epsilon(ledger.dp_event(), DELTA, "rdp") == pytest.approx(best.epsilon, rel=1e-12)
    assert "RDP (selection as ε1²/8-zCDP + training)" in ledger.statement()


def test_non_private_training() -> None:
    ledger = _ledger(training=None)
    assert ledger.end_to_end_dp is False
    assert ledger.overall_epsilon == math.inf
    report = ledger.report()
    json.dumps(report, allow_nan=False)
    assert report["epsilon"] == "inf"
    assert ledger.statement().startswith("NOT differentially private")


def test_replace_one_adjacency_is_recorded() -> None:
    ledger = _ledger(neighboring="replace_one")
    assert ledger.best_bound().neighboring == "replace_one"
    assert "replace-one adjacency" in ledger.statement()
    assert ledger.report()["neighboring"] == "replace_one"


# ---- storage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"phase1": "same-data", "phase1_dataset": "mnist", "selection_eps1": 0.1},
        {"phase1": "none", "phase1_dataset": None},
        {"training": None},
        {"selection_eps1": 0.25, "neighboring": "replace_one", "accountant": "pld"},
        {"training": training_record(0.01, 1.0, 10)},
        {"non_private_updates": 2},
    ],
)
def test_json_round_trip(overrides: dict[str, Any]) -> None:
    ledger = _ledger(**overrides)
    stored = json.loads(json.dumps(ledger.to_json(), allow_nan=False))
    assert event_from_json(stored["dp_event"]) == ledger.dp_event()
    again = PrivacyLedger.from_json(stored)
    assert again == ledger
    assert again.dp_event() == ledger.dp_event()


def test_an_update_outside_the_mechanism_makes_the_run_not_dp() -> None:
    """One optimiser step on an un-noised gradient: no finite ε is claimed anywhere, the DP steps' own ε is
    reported only as such, and the DpEvent tree holds the non-private release (dp-accounting: ε = ∞)."""
    clean, tainted = _ledger(), _ledger(non_private_updates=1)
    assert tainted.best_bound().epsilon == clean.best_bound().epsilon  # what the DP steps alone spent
    assert not tainted.end_to_end_dp and tainted.overall_epsilon == math.inf
    report = tainted.report()
    assert report["end_to_end_dp"] is False and report["overall_epsilon"] == "inf"
    assert report["non_private_updates"] == 1 and "NOT differentially private" in report["warning"]
    assert "not clipped and noised" in tainted.statement()
    accountant = dpa.pld.PLDAccountant()
    accountant.compose(tainted.dp_event())
    assert accountant.get_epsilon(1e-5) == math.inf
    for bad in (-1, True, 1.5):
        with pytest.raises(DpltmUserError, match="non_private_updates"):
            _ledger(non_private_updates=bad)
    hidden = tainted.to_json()
    hidden["non_private_updates"] = 0  # the count dropped, the tree kept: refused
    with pytest.raises(DpltmUserError, match="inconsistent"):
        PrivacyLedger.from_json(hidden)


def test_tampered_or_foreign_records_are_refused() -> None:
    stored = _ledger(phase1="same-data", phase1_dataset="mnist").to_json()
    stored["dp_event"]["events"][0] = {"type": "NoOpDpEvent"}  # hide the leak
    with pytest.raises(DpltmUserError, match="inconsistent"):
        PrivacyLedger.from_json(stored)
    with pytest.raises(DpltmUserError, match="format"):
        PrivacyLedger.from_json({**_ledger().to_json(), "format_version": 99})
    partial = _ledger().to_json()
    del partial["delta"]
    with pytest.raises(DpltmUserError, match="delta"):
        PrivacyLedger.from_json(partial)


@pytest.mark.parametrize(
    "overrides",
    [
        {"phase1": "private"},
        {"phase1": "none", "selection_eps1": 0.1},
        {"selection_eps1": 0.0},
        {"delta": 0.0},
        {"neighboring": "add-remove"},
        {"accountant": "moments"},
        {"noise": "laplace"},
        {"training": {"q": Q, "sigma": 1.0}},  # no steps
        {"training": {**TRAINING, "batch": 400}},  # unknown key
        {"training": {**TRAINING, "q": 0.01}},  # q disagrees with L/N
        {"training": {**TRAINING, "sigma": 0.0}},
    ],
)
def test_invalid_ledgers_raise_user_error(overrides: dict[str, Any]) -> None:
    with pytest.raises(DpltmUserError):
        _ledger(**overrides)


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.9004232, "0.901"), (0.95, "0.95"), (1.0, "1"), (0.1, "0.1"), (12.34, "12.4"),
     (1234.5, "1240"), (math.inf, "∞"), (0.00012341, "0.000124")],
)
def test_displayed_epsilon_is_rounded_up(value: float, text: str) -> None:
    assert round_up(value) == text


def test_non_private_pick_among_same_data_tickets_claims_training_only() -> None:
    """`select --best` on same-data tickets: phase 2 was not DP, so ε may not claim it."""
    ledger = _ledger(phase1="same-data", phase1_dataset="mnist", selection_eps1=None)
    assert isinstance(ledger.selection_event(), dpa.NonPrivateDpEvent)
    assert ledger.epsilon_scope.startswith("training only (phase 3)")
    assert "phases 2-3" not in ledger.statement()
    random_pick = _ledger(phase1="same-data", phase1_dataset="mnist", selection_eps1=None,
                          data_independent_selection=True)
    assert isinstance(random_pick.selection_event(), dpa.NoOpDpEvent)
    assert PrivacyLedger.from_json(random_pick.to_json()) == random_pick
