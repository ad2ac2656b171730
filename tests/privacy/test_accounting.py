"""ε from dp-accounting, checked against docs/privacy.md's figures and against Opacus.

Reference setting (docs/privacy.md §3): N = 60000, L = 400 (q = L/N), 7500 steps, δ = 1e-5,
add/remove adjacency. docs/privacy.md quotes its figures to two or three significant digits, so
they are checked to 1 % relative.
"""

from __future__ import annotations

import functools
import math
import warnings

import dp_accounting as dpa
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import gdp as opacus_gdp
from opacus.accountants.analysis import rdp as opacus_rdp

from dpltm.accounting_report import account_report
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import (
    BASIC_COMPOSITION,
    MAX_EPSILON,
    PLD_MAX_RDP_EPSILON,
    RDP_COMPOSITION,
    TRAINING_ONLY,
    EpsilonOutOfRange,
    best_bound,
    check_target_epsilon,
    composition_bounds,
    delta_for_epsilon,
    epsilon,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
)
from dpltm.privacy.calibration import calibrate_noise_multiplier, calibrate_parameter
from dpltm.privacy.events import MAX_STEPS, MIN_NOISE_MULTIPLIER, check_steps, dpsgd_event, selection_event

Q = 400 / 60000
STEPS = 7500
DELTA = 1e-5
REFERENCE = [  # σ, PLD ε, RDP ε, GDP-CLT ε  (docs/privacy.md §3)
    (2.49, 0.90, 0.99, 0.892),
    (10.43, 0.180, 0.200, 0.179),
]


@functools.cache
def _pld(sigma: float, steps: int = STEPS) -> float:
    return epsilon(dpsgd_event(Q, sigma, steps), DELTA, "pld")


@functools.cache
def _rdp(sigma: float, steps: int = STEPS) -> float:
    return epsilon(dpsgd_event(Q, sigma, steps), DELTA, "rdp")


# ---- reference figures --------------------------------------------------------------------


@pytest.mark.parametrize(("sigma", "pld_ref", "rdp_ref", "_gdp"), REFERENCE)
def test_reference_figures(sigma: float, pld_ref: float, rdp_ref: float, _gdp: float) -> None:
    assert _pld(sigma) == pytest.approx(pld_ref, rel=0.01)
    assert _rdp(sigma) == pytest.approx(rdp_ref, rel=0.01)
    assert _pld(sigma) < _rdp(sigma)  # PLD is the tighter of the two sound accountants


# ---- independent implementations (Opacus) -------------------------------------------------


@pytest.mark.parametrize(("sigma", "steps"), [(2.49, STEPS), (10.43, STEPS), (1.1, 1000)])
def test_rdp_agrees_with_opacus(sigma: float, steps: int) -> None:
    # Opacus computes the subsampled-Gaussian RDP curve with its own code and orders; the
    # RDP → (ε, δ) conversion is the same formula in both (Balle et al. 2020, Thm 21).
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = opacus_rdp.compute_rdp(q=Q, noise_multiplier=sigma, steps=steps, orders=orders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha"
        eps_opacus, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)
    assert _rdp(sigma, steps) == pytest.approx(eps_opacus, rel=0.02)


@pytest.mark.parametrize(("sigma", "steps"), [(2.49, STEPS), (10.43, STEPS), (1.1, 1000)])
def test_pld_agrees_with_opacus_prv(sigma: float, steps: int) -> None:
    # Gopi, Lee & Wutschitz (2021) PRV accountant: a separate numerical composition.
    prv = PRVAccountant()
    prv.history = [(sigma, Q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its domain-size RDP step warns about alphas
        eps_prv = prv.get_epsilon(DELTA, eps_error=0.003)  # its upper estimate
    assert _pld(sigma, steps) == pytest.approx(eps_prv, rel=0.03)


# ---- Gaussian DP: an approximation, not a bound -------------------------------------------


@pytest.mark.parametrize(("sigma", "_pld_ref", "_rdp_ref", "gdp_ref"), REFERENCE)
def test_gdp_clt(sigma: float, _pld_ref: float, _rdp_ref: float, gdp_ref: float) -> None:
    mu = gdp_mu(Q, sigma, STEPS)
    assert mu == pytest.approx(Q * math.sqrt(STEPS * (math.exp(sigma**-2) - 1)), rel=1e-12)
    assert mu == pytest.approx(
        opacus_gdp.compute_mu_poisson(steps=STEPS, noise_multiplier=sigma, sample_rate=Q),
        rel=1e-12,
    )
    eps = gdp_epsilon(mu, DELTA)
    assert gdp_delta(eps, mu) == pytest.approx(DELTA, rel=1e-6)
    assert eps == pytest.approx(opacus_gdp.eps_from_mu(mu=mu, delta=DELTA), rel=1e-6)
    assert eps == pytest.approx(gdp_ref, abs=5e-4)
    # The CLT falls BELOW the PLD upper bound (which is tight to ~1e-3 here): GDP would
    # understate ε, which is why it is never the default (docs/privacy.md §3, §5).
    assert eps < _pld(sigma)


def test_gdp_edge_cases() -> None:
    assert gdp_epsilon(0.0, DELTA) == 0.0
    assert gdp_epsilon(math.inf, DELTA) == math.inf
    assert gdp_mu(Q, 0.01, 10) == math.inf  # e^{1/σ²} overflows: no privacy to speak of
    with pytest.raises(DpltmUserError):
        gdp_epsilon(1.0, 0.0)


# ---- ε and δ, errors ----------------------------------------------------------------------


def test_delta_for_epsilon_inverts_epsilon() -> None:
    event = dpsgd_event(Q, 2.49, STEPS)
    for acc in ("pld", "rdp"):
        eps = epsilon(event, DELTA, acc)
        assert delta_for_epsilon(event, eps, acc) <= DELTA * 1.01
        assert delta_for_epsilon(event, 0.9 * eps, acc) > DELTA


def test_non_private_event_has_infinite_epsilon() -> None:
    event = dpa.ComposedDpEvent([dpa.NonPrivateDpEvent(), dpsgd_event(Q, 1.1, 100)])
    assert epsilon(event, DELTA, "pld") == math.inf
    assert epsilon(event, DELTA, "rdp") == math.inf


def test_pld_refuses_zcdp_by_name() -> None:
    with pytest.raises(DpltmUserError, match=r"PLD.*ZCDpEvent"):
        epsilon(selection_event(0.1), DELTA, "pld")
    composed = dpa.ComposedDpEvent([selection_event(0.1), dpsgd_event(Q, 1.1, 100)])
    with pytest.raises(DpltmUserError, match=r"PLD.*ZCDpEvent"):
        epsilon(composed, DELTA, "pld")
    assert math.isfinite(epsilon(composed, DELTA, "rdp"))


def test_rdp_refuses_poisson_sampling_under_replace_one() -> None:
    event = dpsgd_event(Q, 2.49, 100)
    with pytest.raises(DpltmUserError, match=r"RDP.*PoissonSampledDpEvent.*replace-one"):
        epsilon(event, DELTA, "rdp", "replace_one")
    # PLD handles it, and the RDP composition bound is then simply not offered.
    bounds = composition_bounds(0.1, event, DELTA, "pld", "replace_one")
    assert [b.name for b in bounds] == [BASIC_COMPOSITION]
    assert bounds[0].neighboring == "replace_one"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accountant": "gdp"},
        {"neighboring": "replace_special"},
        {"delta": 0.0},
        {"delta": 1.0},
    ],
)
def test_bad_arguments_raise_user_error(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"delta": DELTA, "accountant": "pld", "neighboring": "add_remove"}
    args.update(kwargs)
    with pytest.raises(DpltmUserError):
        epsilon(dpsgd_event(Q, 1.1, 10), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("q", "sigma", "steps"), [(0.0, 1.0, 10), (1.5, 1.0, 10), (0.1, 0.0, 10), (0.1, 1.0, 0)]
)
def test_bad_dpsgd_event_raises_user_error(q: float, sigma: float, steps: int) -> None:
    with pytest.raises(DpltmUserError):
        dpsgd_event(q, sigma, steps)


# ---- composition of selection and training ------------------------------------------------


def test_public_tickets_give_the_training_bound_alone() -> None:
    (bound,) = composition_bounds(None, dpsgd_event(Q, 2.49, STEPS), DELTA)
    assert bound.name == TRAINING_ONLY
    assert bound.epsilon == _pld(2.49)
    assert (bound.delta, bound.accountant, bound.neighboring) == (DELTA, "pld", "add_remove")


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_composition_bounds(accountant: str) -> None:
    training = dpsgd_event(Q, 2.49, STEPS)
    eps_train = _pld(2.49) if accountant == "pld" else _rdp(2.49)
    bounds = {b.name: b for b in composition_bounds(0.1, training, DELTA, accountant)}
    assert set(bounds) == {BASIC_COMPOSITION, RDP_COMPOSITION}
    assert bounds[BASIC_COMPOSITION].epsilon == pytest.approx(0.1 + eps_train, rel=1e-12)
    assert bounds[RDP_COMPOSITION].accountant == "rdp"
    best = best_bound(list(bounds.values()))
    assert best.epsilon <= bounds[BASIC_COMPOSITION].epsilon
    assert best.epsilon == min(b.epsilon for b in bounds.values())
    if accountant == "rdp":
        # Same accountant for training: adding ε1²/8·α to the RDP curve costs less than ε1.
        assert bounds[RDP_COMPOSITION].epsilon < bounds[BASIC_COMPOSITION].epsilon
        assert best.name == RDP_COMPOSITION


def test_basic_composition_wins_for_a_large_eps1() -> None:
    bounds = composition_bounds(3.0, dpsgd_event(Q, 2.49, STEPS), DELTA, "rdp")
    assert best_bound(bounds).name == BASIC_COMPOSITION


# ---- calibration --------------------------------------------------------------------------

# The reference setting keeps σ* above 1, where one PLD evaluation takes ~0.1 s (at
# σ ≈ 0.6 it takes ~1 s).
CAL_STEPS = STEPS


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target", [0.3, 1.0, 2.0])
def test_calibrated_sigma_meets_the_target_tightly(accountant: str, target: float) -> None:
    sigma = calibrate_noise_multiplier(Q, CAL_STEPS, target, DELTA, accountant)
    eps = epsilon(dpsgd_event(Q, sigma, CAL_STEPS), DELTA, accountant)
    assert eps <= target
    assert epsilon(dpsgd_event(Q, 0.98 * sigma, CAL_STEPS), DELTA, accountant) > target


@pytest.mark.parametrize(
    ("accountant", "composition"), [("pld", "best"), ("pld", "basic"), ("rdp", "rdp")]
)
def test_calibration_with_selection(accountant: str, composition: str) -> None:
    target, eps1 = 1.0, 0.1

    def reported(sigma: float) -> float:
        bounds = composition_bounds(eps1, dpsgd_event(Q, sigma, CAL_STEPS), DELTA, accountant)
        if composition != "best":
            bounds = [b for b in bounds if b.name == f"{composition}-composition"]
        return best_bound(bounds).epsilon

    sigma = calibrate_noise_multiplier(
        Q, CAL_STEPS, target, DELTA, accountant, selection_eps1=eps1,
        composition=composition,  # type: ignore[arg-type]
    )
    assert reported(sigma) <= target
    assert reported(0.98 * sigma) > target
    # Spending ε1 on selection needs more noise than training alone.
    assert sigma > calibrate_noise_multiplier(Q, CAL_STEPS, target, DELTA, accountant)


def test_calibration_errors() -> None:
    # a target so small that σ would pass the bound a given --sigma has: refused alike, naming σ
    with pytest.raises(DpltmUserError, match="needs a noise multiplier of .* above the 10000"):
        calibrate_noise_multiplier(0.1, 100, 1e-6, DELTA)
    with pytest.raises(DpltmUserError):
        calibrate_noise_multiplier(Q, CAL_STEPS, 0.0, DELTA)
    with pytest.raises(DpltmUserError):
        calibrate_noise_multiplier(Q, CAL_STEPS, -1.0, DELTA)
    # Selection alone already exceeds the target under every composition.
    with pytest.raises(DpltmUserError, match="selection"):
        calibrate_noise_multiplier(Q, CAL_STEPS, 0.1, DELTA, selection_eps1=0.2)
    with pytest.raises(DpltmUserError):
        calibrate_noise_multiplier(Q, CAL_STEPS, 1.0, DELTA, accountant="moments")


# ---- bounds on what the accountants are asked ---------------------------------------------


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "message"),
    [
        (0.1, MIN_NOISE_MULTIPLIER * 0.99, 10, "below 0.3"),
        (0.1, 1e-9, 10, "below 0.3"),
        (0.1, math.inf, 10, "finite"),
        (0.1, math.nan, 10, "finite"),
        (math.nan, 1.0, 10, "sample rate"),
        (0.1, 1.0, MAX_STEPS + 1, "at most 1e\\+06"),
        (0.1, 1.0, 10**12, "at most"),
        (0.1, 1.0, 2.5, "positive integer"),
        (0.1, 1.0, True, "positive integer"),
    ],
)
def test_dpsgd_event_bounds(q: float, sigma: float, steps: int, message: str) -> None:
    with pytest.raises(DpltmUserError, match=message):
        dpsgd_event(q, sigma, steps)


def test_dpsgd_event_at_the_bounds_is_accepted() -> None:
    assert dpsgd_event(1.0, MIN_NOISE_MULTIPLIER, MAX_STEPS).count == MAX_STEPS
    assert check_steps(10.0) == 10


@pytest.mark.parametrize("target", [0.0, -1.0, MAX_EPSILON * 1.001, 1e9, math.inf, math.nan])
def test_target_epsilon_bounds(target: float) -> None:
    with pytest.raises(DpltmUserError, match=r"--eps must lie in \(0, 100\]"):
        check_target_epsilon(target, "--eps")
    with pytest.raises(DpltmUserError, match="target epsilon"):
        calibrate_noise_multiplier(Q, 10, target, DELTA)
    assert check_target_epsilon(MAX_EPSILON) == MAX_EPSILON


def test_pld_is_not_run_where_rdp_already_puts_epsilon_out_of_range() -> None:
    """q = 1, σ = 1, 10⁶ steps: RDP ε ≈ 5.5·10⁵; PLD would need tens of GB. Refused at once."""
    event = dpsgd_event(1.0, 1.0, MAX_STEPS)
    assert epsilon(event, DELTA, "rdp") > PLD_MAX_RDP_EPSILON  # RDP itself is cheap
    with pytest.raises(EpsilonOutOfRange, match="no meaningful privacy"):
        epsilon(event, DELTA, "pld")
    with pytest.raises(EpsilonOutOfRange):
        delta_for_epsilon(event, 1.0, "pld")
    with pytest.raises(EpsilonOutOfRange):  # replace-one: RDP's add/remove bound stands in
        epsilon(event, DELTA, "pld", "replace_one")


def test_the_pld_cost_guard_skips_only_runs_a_passed_one_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DP-SGD run with at least as much noise and at most as many steps as one that passed the guard
    passes without RDP work; more steps or less noise is checked again and still refused when out of range."""
    from dpltm.privacy import accounting

    monkeypatch.setattr(accounting, "_GUARD_PASSED", {})
    checks = []
    real = accounting.make_accountant
    monkeypatch.setattr(accounting, "make_accountant",
                        lambda name, *a: checks.append(name) or real(name, *a))  # type: ignore[func-returns-value]
    q = 0.01
    accounting._check_pld_cost(dpsgd_event(q, 1.0, 1000), DELTA, "add_remove")
    ran = len(checks)
    assert ran > 0
    for sigma, steps in ((1.0, 1000), (1.5, 10), (1.0, 999)):  # covered: no RDP accountant made
        accounting._check_pld_cost(dpsgd_event(q, sigma, steps), DELTA, "add_remove")
    assert len(checks) == ran
    accounting._check_pld_cost(dpsgd_event(q, 1.0, 1001), DELTA, "add_remove")  # one step more: checked
    assert len(checks) > ran
    accounting._check_pld_cost(dpsgd_event(q, 1.0, 5), DELTA, "replace_one")  # another relation: checked
    accounting._check_pld_cost(dpsgd_event(0.5, 1.0, 10), DELTA, "add_remove")
    with pytest.raises(EpsilonOutOfRange):  # less noise, more steps: checked, and refused
        accounting._check_pld_cost(dpsgd_event(0.5, 0.4, 100000), DELTA, "add_remove")
    with pytest.raises(EpsilonOutOfRange):
        accounting._check_pld_cost(dpsgd_event(1.0, 1.0, MAX_STEPS), DELTA, "add_remove")


@pytest.mark.parametrize("path", ["accountant", "dp-sgd one-step pld"])
def test_dp_accounting_failures_become_one_user_error(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpltm.privacy import accounting, pld_accountant

    def fail(*args: object, **kwargs: object) -> None:
        raise ValueError("Maximum allowed size exceeded\nmore detail")

    accounting._epsilon_cached.cache_clear()  # nothing answered from an earlier test's query
    if path == "accountant":  # any other event: dp-accounting's PLDAccountant composes it
        monkeypatch.setattr(dpa.pld.PLDAccountant, "compose", fail)
        event = dpa.ComposedDpEvent([dpsgd_event(0.5, 3.0, 17), dpsgd_event(0.25, 3.0, 5)])
    else:  # DP-SGD's event: its one-step PLD is built by dp-accounting and kept
        pld_accountant._subsampled_gaussian_pld.cache_clear()
        monkeypatch.setattr(pld_accountant.pld_lib, "from_gaussian_mechanism", fail)
        event = dpsgd_event(0.5, 3.0, 17)
    with pytest.raises(DpltmUserError, match="PLD accountant failed at this setting: Maximum allowed size exceeded$"):
        epsilon(event, DELTA, "pld")


def test_calibration_stops_at_the_smallest_sigma() -> None:
    """A loose target that even σ = MIN_NOISE_MULTIPLIER meets: that σ, without searching below."""
    sigma = calibrate_noise_multiplier(1e-4, 10, MAX_EPSILON, DELTA)
    assert sigma == MIN_NOISE_MULTIPLIER
    assert epsilon(dpsgd_event(1e-4, sigma, 10), DELTA) <= MAX_EPSILON


def test_calibration_climbs_out_of_the_refused_range() -> None:
    """Started where PLD is refused (RDP ε > 1000), the search treats it as over target."""
    def event(sigma: float) -> dpa.DpEvent:
        return dpsgd_event(1.0, sigma, 300)

    with pytest.raises(EpsilonOutOfRange):
        epsilon(event(MIN_NOISE_MULTIPLIER), DELTA, "pld")
    sigma = calibrate_parameter(event, 50.0, DELTA, "pld", initial_guess=MIN_NOISE_MULTIPLIER,
                                lower=MIN_NOISE_MULTIPLIER)
    assert epsilon(event(sigma), DELTA, "pld") <= 50.0 < epsilon(event(0.98 * sigma), DELTA, "pld")


# ---- `dpltm account`: conflicting and out-of-range options --------------------------------

ACCOUNT = {"q": None, "sigma": None, "steps": None, "delta": DELTA, "dataset_size": None, "batch_size": None,
           "epochs": None, "eps": None, "eps1": None}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"q": 0.01, "steps": 100, "sigma": 1.0, "eps": 1.0}, "not both"),
        ({"q": 0.01, "steps": 100, "sigma": 1.0, "dataset_size": 1000}, "not both"),
        ({"q": 0.01, "sigma": 1.0, "batch_size": 10, "epochs": 1, "dataset_size": 1000}, "not both"),
        ({"steps": 100, "epochs": 2, "sigma": 1.0}, "not both"),
        ({"q": 0.01, "steps": 100}, "give --sigma"),
        ({"q": 0.01, "sigma": 1.0}, "give --q and --steps"),
        ({"dataset_size": 0, "batch_size": 10, "epochs": 1, "sigma": 1.0}, "--dataset-size must be a positive"),
        ({"dataset_size": 100, "batch_size": -1, "epochs": 1, "sigma": 1.0}, "--batch-size must be a positive"),
        ({"dataset_size": 60000, "batch_size": 1, "epochs": 100, "sigma": 1.0}, "steps must be at most"),
        ({"q": 0.01, "steps": 100, "sigma": 1e-9}, r"--sigma must be a finite number in \[0.3, 10000\]"),
        ({"q": 0.01, "steps": 100, "eps": 1e9}, r"--eps must lie in \(0, 100\]"),
        ({"q": 0.01, "steps": 100, "sigma": 1.0, "eps1": 1e308}, r"eps1 must lie in \(0, 100\]"),
        ({"q": 0.01, "steps": 100, "sigma": 1.0, "delta": math.nan}, "delta"),
        ({"q": 1.0, "steps": MAX_STEPS, "sigma": 1.0}, "no meaningful privacy"),
    ],
)
def test_account_report_refuses_in_one_line(given: dict[str, object], message: str) -> None:
    with pytest.raises(DpltmUserError, match=message):
        account_report(**{**ACCOUNT, **given})  # type: ignore[arg-type]


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_dpsgd_epsilon_from_the_cached_one_step_pld_is_dp_accountings_bit_for_bit(neighboring: str) -> None:
    """DP-SGD's ε is computed from a one-step PLD built once and self-composed per query: each value
    must be exactly what a fresh `PLDAccountant` gives for the event, whatever was asked before it
    (the cached PLD is never changed by composing it), nested self-compositions included."""
    from dpltm.privacy import accounting, pld_accountant

    relation = {"add_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                "replace_one": dpa.NeighboringRelation.REPLACE_ONE}[neighboring]
    pld_accountant._subsampled_gaussian_pld.cache_clear()
    step = dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1))
    for event, delta in [(dpa.SelfComposedDpEvent(step, 300), 1e-5), (dpa.SelfComposedDpEvent(step, 20), 1e-5),
                         (dpa.SelfComposedDpEvent(dpa.SelfComposedDpEvent(step, 25), 12), 1e-6),
                         (dpa.SelfComposedDpEvent(step, 300), 1e-5)]:
        independent = dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-4)
        independent.compose(event)
        accounting._epsilon_cached.cache_clear()
        assert accounting.epsilon(event, delta, "pld", neighboring) == float(independent.get_epsilon(delta))
    assert pld_accountant._subsampled_gaussian_pld.cache_info().currsize == 1  # one one-step PLD served all four


def test_rdp_underflow_to_zero_is_refused_not_reported_as_a_bound() -> None:
    """dp-accounting's RDP accountant returns ε = 0 once every order underflows (σ around 2e4 and more): that is
    no bound for a finite σ (PLD gives a positive ε there), so it is refused; `account` keeps the PLD row."""
    event = dpsgd_event(64 / 1345, 22324.0, 21)
    assert epsilon(event, 1e-5, "pld") > 0
    with pytest.raises(DpltmUserError, match="underflows to epsilon 0"):
        epsilon(event, 1e-5, "rdp")
    report = account_report(q=0.01, sigma=None, steps=100, delta=1e-5, eps=0.001, eps1=None, dataset_size=None,
                            batch_size=None, epochs=None, noise="gaussian", neighboring="add_remove")
    rows = {row["accountant"]: row for row in report["rows"]}
    assert rows["pld"]["kind"] == "upper bound" and rows["pld"]["sigma"] > 100
    assert rows["rdp"]["sigma"] is None and "underflows" in rows["rdp"]["kind"]


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize(("eps1", "target"), [(0.1, 2.0), (0.5, 2.0), (0.05, 1.5), (0.1, 0.8)])
def test_calibration_after_spent_segments_with_a_selection_meets_the_ledgers_best_bound(
        accountant: str, eps1: float, target: float) -> None:
    """A resumed library run whose ticket was chosen with ε1: σ for the new segment is the smallest for which the
    best of the ledger's bounds (basic ε1 + ε(spent, training); RDP of [selection, spent, training]) meets the
    target, so it is met, tightly, and never with more noise than basic composition alone asks."""
    spent = [dpsgd_event(0.05, 3.0, 40)]
    sigma = calibrate_noise_multiplier(0.05, 60, target, 1e-5, accountant, selection_eps1=eps1, spent=spent)
    ran = dpa.ComposedDpEvent([*spent, dpsgd_event(0.05, sigma, 60)])
    assert target * 0.99 < best_bound(composition_bounds(eps1, ran, 1e-5, accountant)).epsilon <= target
    basic_only = calibrate_noise_multiplier(0.05, 60, target, 1e-5, accountant, selection_eps1=eps1, spent=spent,
                                            composition="basic")
    assert sigma <= basic_only
    ran_basic = dpa.ComposedDpEvent([*spent, dpsgd_event(0.05, basic_only, 60)])
    assert eps1 + epsilon(ran_basic, 1e-5, accountant) <= target
    with pytest.raises(DpltmUserError, match="after what already ran"):
        calibrate_noise_multiplier(0.05, 60, 0.5, 1e-5, accountant, selection_eps1=0.45, spent=spent)
