"""Phase 2: the exponential mechanism over tickets (McSherry & Talwar 2007; docs/privacy.md §2)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpltm.errors import DpltmUserError
from dpltm.privacy.events import selection_event
from dpltm.privacy.exponential import (
    MAX_EPS1,
    check_eps1,
    decisive_eps1,
    make_selection_rng,
    near_uniform,
    sample_exponential,
    score_sensitivity,
    selection_log_probabilities,
    selection_probabilities,
    ticket_scores,
)

# The paper's setting (docs/privacy.md §2): ν = 50, ten IMP rounds of 30 % each.
NU = 50.0
DENSITIES = 0.7 ** np.arange(10)
ACCURACIES = np.full(10, 0.97)


# ---- scores and sensitivity ---------------------------------------------------------------


def test_scores_follow_the_paper_formula() -> None:
    s = ticket_scores([0.9, 0.5], [1.0, 0.1], nu=2.0)
    np.testing.assert_allclose(s, [0.9 * (1 - 2.0), 0.5 * (1 - 0.2)])


def test_sensitivity_is_abs_one_minus_nu_with_the_dense_ticket() -> None:
    # Lemma 1 of the paper: |1 − ν| when C = 1 is a candidate and ν > 1.
    assert score_sensitivity(DENSITIES, NU) == pytest.approx(49.0, abs=0.0)
    assert score_sensitivity([1.0, 0.3], 3.0) == pytest.approx(2.0)


def test_sensitivity_without_the_dense_ticket_and_for_small_nu() -> None:
    # Without C = 1 the largest |1 − ν·C| is smaller than |1 − ν|.
    assert score_sensitivity(DENSITIES[1:], NU) == pytest.approx(abs(1 - NU * 0.7))
    # ν < 1: every 1 − ν·C is positive and largest at the sparsest ticket.
    assert score_sensitivity([1.0, 0.1], 0.5) == pytest.approx(0.95)


def test_sensitivity_scales_with_accuracy_sensitivity() -> None:
    n = 1000  # accuracies on a holdout of n records that did not shape the tickets
    assert score_sensitivity(DENSITIES, NU, accuracy_sensitivity=1 / n) == pytest.approx(49 / n)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    k=st.integers(min_value=1, max_value=8),
    nu=st.floats(min_value=0.0, max_value=100.0),
)
def test_sensitivity_bounds_every_score_change(data: st.DataObject, k: int, nu: float) -> None:
    # docs/privacy.md §2: densities fixed, accuracies change arbitrarily in [0, 1].
    acc = st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k)
    c = data.draw(st.lists(st.floats(1e-3, 1.0), min_size=k, max_size=k))
    a, a2 = data.draw(acc), data.draw(acc)
    delta = score_sensitivity(c, nu)
    diff = np.abs(ticket_scores(a, c, nu) - ticket_scores(a2, c, nu))
    assert np.all(diff <= delta * (1 + 1e-12) + 1e-12)


# ---- the distribution ---------------------------------------------------------------------


def test_probabilities_are_a_stable_softmax() -> None:
    s = ticket_scores(ACCURACIES, DENSITIES, NU)
    p = selection_probabilities(s, 0.1, 49.0)
    assert p.dtype == np.float64
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    logits = 0.1 * s / (2 * 49.0)
    np.testing.assert_allclose(p, np.exp(logits) / np.exp(logits).sum(), rtol=1e-12)
    # Huge ε1/Δ: no overflow, no NaN, the best ticket takes all the mass.
    logp = selection_log_probabilities([0.0, 1.0, -5.0], 1e6, 1e-3)
    assert np.all(np.isfinite(logp))
    assert np.exp(logp[1]) == pytest.approx(1.0)


def test_privacy_md_figure_selection_is_near_uniform() -> None:
    # docs/privacy.md §2 quotes "0.097–0.101" to three decimals for ε1 = 0.1; the exact values
    # are 0.0967 ... 0.1014, so we check the figure after rounding to three decimals.
    s = ticket_scores(ACCURACIES, DENSITIES, NU)
    delta = score_sensitivity(DENSITIES, NU)
    p = selection_probabilities(s, 0.1, delta)
    assert np.round(p, 3).min() >= 0.097
    assert np.round(p, 3).max() <= 0.101
    assert near_uniform(p)
    # ...and a decisive distribution is not.
    assert not near_uniform(selection_probabilities(s, 500.0, delta))


def test_chi_square_goodness_of_fit_seeded() -> None:
    scores = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 0.2])
    eps1, delta = 2.0, 1.0
    p = selection_probabilities(scores, eps1, delta)
    rng = make_selection_rng(12345)
    n = 20_000
    draws = np.array([sample_exponential(scores, eps1, delta, rng) for _ in range(n)])
    observed = np.bincount(draws, minlength=scores.size)
    result = stats.chisquare(observed, f_exp=n * p)
    assert result.pvalue > 1e-3


def test_seeded_rng_is_reproducible() -> None:
    s = [0.1, 0.2, 0.3, 0.4]
    r1, r2 = make_selection_rng(3), make_selection_rng(3)
    assert [sample_exponential(s, 1.0, 0.1, r1) for _ in range(50)] == [
        sample_exponential(s, 1.0, 0.1, r2) for _ in range(50)
    ]


def test_secure_rng_path() -> None:
    rng = make_selection_rng(None)
    assert isinstance(rng, random.SystemRandom)
    # Decisive: always the best ticket, with an explicit secure rng and with rng=None.
    assert sample_exponential([0.0, 10.0, 1.0], 100.0, 0.01, rng) == 1
    assert sample_exponential([0.0, 10.0, 1.0], 100.0, 0.01) == 1
    # P = (0.9, 0.1): 2000 unseeded draws land within 7 standard deviations of 1800.
    scores = [2 * math.log(9.0), 0.0]  # ε1/(2Δ) = 1/2: logits (ln 9, 0), odds 9:1
    counts = [0, 0]
    for _ in range(2000):
        counts[sample_exponential(scores, 1.0, 1.0, rng)] += 1
    assert 1700 < counts[0] < 1900


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    k=st.integers(min_value=1, max_value=10),
    eps1=st.floats(min_value=1e-3, max_value=20.0),
    delta=st.floats(min_value=1e-2, max_value=100.0),
)
def test_neighbouring_scores_change_probabilities_by_at_most_e_eps1(
    data: st.DataObject, k: int, eps1: float, delta: float
) -> None:
    # McSherry & Talwar (2007): if every score moves by at most Δ, every
    # probability changes by at most a factor e^{ε1}.
    # |logits| ≤ 1e5, so float64 rounding stays far below the 1e-9 slack.
    scores = np.array(data.draw(st.lists(st.floats(-100.0, 100.0), min_size=k, max_size=k)))
    moves = np.array(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=k, max_size=k)))
    neighbour = scores + delta * moves
    lp = selection_log_probabilities(scores, eps1, delta)
    lq = selection_log_probabilities(neighbour, eps1, delta)
    assert np.max(np.abs(lp - lq)) <= eps1 + 1e-9 * max(1.0, eps1)
    assert np.max(np.exp(lp - lq)) <= math.exp(eps1) * (1 + 1e-9)


# ---- telling users how decisive the selection is ------------------------------------------


def test_decisive_eps1_reaches_the_target_and_a_bit_less_does_not() -> None:
    s = ticket_scores(ACCURACIES, DENSITIES, NU)
    delta = score_sensitivity(DENSITIES, NU)
    best = int(np.argmax(s))
    for target in (0.5, 0.9, 0.99):
        e = decisive_eps1(s, delta, target)
        assert math.isfinite(e) and e > 0.1  # far above the paper's ε1 = 0.1
        assert selection_probabilities(s, e, delta)[best] >= target
        assert selection_probabilities(s, 0.99 * e, delta)[best] < target


def test_decisive_eps1_edge_cases() -> None:
    assert decisive_eps1([1.0, 1.0, 0.0], 1.0, 0.9) == math.inf  # a tie caps P at 1/2
    assert math.isfinite(decisive_eps1([1.0, 1.0, 0.0], 1.0, 0.45))
    assert decisive_eps1([0.3], 1.0, 0.9) == 0.0  # one candidate: always chosen
    assert decisive_eps1([0.0, 1.0], 1.0, 0.4) == 0.0  # target below 1/k


def test_holdout_sensitivity_makes_selection_sharp_at_small_eps1() -> None:
    # docs/privacy.md §2: scored on n = 10000 held-out records, ΔA = 1/n.
    acc = np.linspace(0.90, 0.97, 10)
    dens = DENSITIES[::-1]
    s = ticket_scores(acc, dens, 0.5)
    delta = score_sensitivity(dens, 0.5, accuracy_sensitivity=1e-4)
    # Even two tickets 2e-4 apart in score are told apart at ε1 ≈ 2, against ε1 ≈ 260 at the
    # paper's Δ = 49 (previous test).
    assert decisive_eps1(s, delta, 0.9) < 2.5
    assert not near_uniform(selection_probabilities(s, 0.5, delta))


# ---- input validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: ticket_scores([], [], 1.0),
        lambda: ticket_scores([0.5, 0.5], [1.0], 1.0),
        lambda: ticket_scores([1.5], [1.0], 1.0),
        lambda: ticket_scores([0.5], [0.0], 1.0),
        lambda: ticket_scores([0.5], [1.2], 1.0),
        lambda: ticket_scores([0.5], [1.0], -1.0),
        lambda: ticket_scores([[0.5]], [[1.0]], 1.0),  # type: ignore[list-item]
        lambda: ticket_scores([float("nan")], [1.0], 1.0),
        lambda: score_sensitivity([1.0], 2.0, accuracy_sensitivity=0.0),
        lambda: score_sensitivity([1.0], 2.0, accuracy_sensitivity=2.0),
        lambda: selection_probabilities([1.0, 2.0], 0.0, 1.0),
        lambda: selection_probabilities([1.0, 2.0], -1.0, 1.0),
        lambda: selection_probabilities([1.0, 2.0], float("inf"), 1.0),
        lambda: selection_probabilities([1.0, 2.0], 1.0, 0.0),
        lambda: selection_probabilities([], 1.0, 1.0),
        lambda: decisive_eps1([1.0, 2.0], 1.0, 1.0),
        lambda: near_uniform([0.5, 0.5], tolerance=-1.0),
        lambda: make_selection_rng(1.5),  # type: ignore[arg-type]
        lambda: sample_exponential([1.0, 2.0], 1e308, 1.0),
        lambda: sample_exponential([1.0, 2.0], MAX_EPS1 * 1.01, 1.0),
    ],
)
def test_user_mistakes_raise_dpltm_user_error(call: object) -> None:
    with pytest.raises(DpltmUserError):
        call()  # type: ignore[operator]


# ---- the bound on ε1 ----------------------------------------------------------------------


@pytest.mark.parametrize("eps1", [1e-9, 0.1, MAX_EPS1])
def test_eps1_up_to_the_bound_is_accepted(eps1: float) -> None:
    assert check_eps1(eps1) == eps1
    assert selection_event(eps1).rho == pytest.approx(eps1**2 / 8)
    assert 0 <= sample_exponential([0.1, 0.9], eps1, 1.0, make_selection_rng(0)) <= 1


@pytest.mark.parametrize("eps1", [0.0, -1.0, MAX_EPS1 * 1.001, 1e308, math.inf, math.nan, "x"])
def test_eps1_beyond_the_bound_is_one_user_error_not_an_overflow(eps1: object) -> None:
    with pytest.raises(DpltmUserError, match=r"--eps1 must (lie in \(0, 100\]|be a number)"):
        check_eps1(eps1, "--eps1")  # type: ignore[arg-type]
    with pytest.raises(DpltmUserError, match="eps1"):
        selection_event(eps1)  # type: ignore[arg-type]  # ε1²/8 would overflow at 1e308


def test_decisive_eps1_may_exceed_the_bound() -> None:
    """An informational figure (what ε1 would make the pick decisive), not a budget: unbounded."""
    assert decisive_eps1(ticket_scores(ACCURACIES, DENSITIES, NU), score_sensitivity(DENSITIES, NU)) > MAX_EPS1
