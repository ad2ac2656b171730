"""ε from a real accountant, and every valid way to compose selection with training.

The sound accountants, each an upper bound on the true ε, are the registry's
(dpltm.privacy.accountants): PLD (dpltm/privacy/pld_accountant.py, the default) and RDP
(dpltm/privacy/rdp_accountant.py, which also composes the exponential mechanism as zCDP).

The Gaussian-DP central limit theorem (Bu, Dong, Long & Su 2020) is offered separately as
a labelled *approximation* (`gdp_mu`, `gdp_epsilon`): it can fall below the true ε.

Neighbouring relation is explicit: ``"add_remove"`` (add/remove one record; default, what
Poisson sampling is analysed under) or ``"replace_one"``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import numbers
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dp_accounting import (  # type: ignore[import-untyped]
    ComposedDpEvent,
    GaussianDpEvent,
    NeighboringRelation,
    PoissonSampledDpEvent,
    PrivacyAccountant,
    SelfComposedDpEvent,
)
from scipy import optimize, special  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError
from dpltm.privacy.accountants import ACCOUNTANTS, accountant_entry
from dpltm.privacy.display import format_epsilon
from dpltm.privacy.events import DpEvent, event_from_json, event_to_json, selection_event

NEIGHBORING = ("add_remove", "replace_one")

_RELATIONS = {
    "add_remove": NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": NeighboringRelation.REPLACE_ONE,
}

NEIGHBORING_LABELS = {"add_remove": "add/remove-one", "replace_one": "replace-one"}


# ---- checks -------------------------------------------------------------------------------
#
# Validation happens once, at the edge (settings, `dpltm account`, the public functions
# below); the calibration search then calls `epsilon_unchecked`, which trusts its arguments.

#: The largest target ε accepted (training budget, calibration target, --max-eps). ε = 100
#: is already no privacy at all (e^100); larger targets only make the accountants work harder.
MAX_EPSILON = 100.0

#: The PLD accountant is run only where the (cheap) RDP bound on ε is at most this. PLD's cost
#: grows with the range of the privacy loss (its support is a 1e-4 grid over that range):
#: below this bound one evaluation takes seconds and under 1 GB (σ ≥ 0.3, T ≤ 10⁶); at
#: q = 1, σ = 1, T = 10⁶ (RDP ε ≈ 5·10⁵) it would need tens of GB.
PLD_MAX_RDP_EPSILON = 1000.0

#: δ at which `delta_for_epsilon` measures PLD's cost (its cost does not depend on δ).
_COST_REFERENCE_DELTA = 1e-5


class EpsilonOutOfRange(DpltmUserError):
    """ε is beyond what dpltm accounts for (see `PLD_MAX_RDP_EPSILON`)."""


def check_accountant(accountant: object, option: str = "accountant") -> str:
    """The name of a registered accountant (dpltm.privacy.accountants), or one line naming `option`."""
    return accountant_entry(accountant, option).name


NEIGHBORING_NAMES = {"add_remove": "add_remove", "add-remove": "add_remove", "add/remove": "add_remove",
                     "replace_one": "replace_one", "replace-one": "replace_one"}
"""Accepted spellings of the neighbouring relation: add/remove-one (Opacus's and TF Privacy's convention, N
treated as public) or replace-one (N fixed; a larger ε for the same run)."""


def check_neighboring(neighboring: object, name: str = "neighboring") -> str:
    """The relation in the accountants' spelling (`NEIGHBORING`), from any accepted one, or one line."""
    key = neighboring.strip().lower() if isinstance(neighboring, str) else None
    if key not in NEIGHBORING_NAMES:
        shown = repr(neighboring) if isinstance(neighboring, str) else type(neighboring).__name__
        raise DpltmUserError(f"{name} must be 'add_remove' or 'replace_one', got {shown}")
    return NEIGHBORING_NAMES[key]  # type: ignore[index]


def check_delta(delta: object, name: str = "delta") -> float:
    """δ as a float in (0, 1), or one line naming `name`."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise DpltmUserError(f"{name} must be a number, got {type(delta).__name__}")
    d = float(delta)
    if not 0.0 < d < 1.0:  # NaN too
        raise DpltmUserError(f"{name} must lie in (0, 1), got {d:g}")
    return d


def check_target_epsilon(target_epsilon: float, option: str = "target epsilon") -> float:
    """A target ε as a float in (0, MAX_EPSILON], or a DpltmUserError naming `option`."""
    t = float(target_epsilon)
    if not (math.isfinite(t) and 0.0 < t <= MAX_EPSILON):
        raise DpltmUserError(f"{option} must lie in (0, {MAX_EPSILON:g}], got {target_epsilon}")
    return t


def make_accountant(accountant: str = "pld", neighboring: str = "add_remove") -> PrivacyAccountant:
    """A fresh dp-accounting accountant of the named kind (see the module docstring)."""
    relation = _RELATIONS[check_neighboring(neighboring)]
    return accountant_entry(accountant).load().make(relation)  # type: ignore[no-any-return]


def _offending_subevent(acc: PrivacyAccountant, event: DpEvent) -> DpEvent:
    """The innermost sub-event `acc` refuses, found with the side-effect-free `supports`."""
    if isinstance(event, ComposedDpEvent):
        for sub in event.events:
            if not acc.supports(sub):
                return _offending_subevent(acc, sub)
    if isinstance(event, SelfComposedDpEvent) and not acc.supports(event.event):
        return _offending_subevent(acc, event.event)
    return event


def require_support(event: DpEvent, accountant: str, neighboring: str) -> None:
    """Raise DpltmUserError unless the accountant can analyse `event`.

    Checked before anything runs (dp-accounting's `supports` has no side effects), so a run
    fails before spending any privacy budget.
    """
    acc = make_accountant(accountant, neighboring)
    if not acc.supports(event):
        bad = type(_offending_subevent(acc, event)).__name__
        raise DpltmUserError(
            f"the {ACCOUNTANTS[accountant].label} accountant cannot account for {bad} under "
            f"{NEIGHBORING_LABELS[neighboring]} adjacency; try another accountant or relation"
        )


def _check_pld_cost(event: DpEvent, delta: float, neighboring: str) -> None:
    """Refuse to run PLD where the RDP bound says ε > PLD_MAX_RDP_EPSILON (its cost grows with ε).

    RDP's ε is an upper bound too, so the refusal never hides a small ε. Where RDP cannot
    analyse the event under `neighboring` (Poisson sampling under replace-one), the
    add/remove-one bound stands in: replace-one ε is at most about twice it.
    """
    shape = _dpsgd_shape(event)
    if shape is not None and _guard_passed(shape, delta, neighboring):
        return
    relation = neighboring
    if not make_accountant("rdp", relation).supports(event):
        relation = "add_remove"
        if not make_accountant("rdp", relation).supports(event):
            return
    acc = make_accountant("rdp", relation)
    with _quiet_rdp_warnings():
        acc.compose(event)
        bound = float(acc.get_epsilon(delta))
    if math.isfinite(bound) and bound > PLD_MAX_RDP_EPSILON:
        raise EpsilonOutOfRange(
            f"epsilon is {format_epsilon(bound)} by the RDP bound at delta {delta:g}: no meaningful privacy; dpltm "
            f"accounts only up to epsilon {PLD_MAX_RDP_EPSILON:g} (use more noise or fewer steps)"
        )
    if shape is not None:
        with _GUARD_LOCK:
            passed = _GUARD_PASSED.setdefault((shape[0], delta, neighboring), [])
            passed[:] = [(s, t) for s, t in passed if not (s >= shape[1] and t <= shape[2])][-31:]
            passed.append((shape[1], shape[2]))  # only runs no other covers, at most 32


_GUARD_LOCK = threading.Lock()
_GUARD_PASSED: dict[tuple[float, float, str], list[tuple[float, int]]] = {}
"""(q, δ, relation) → the (σ, T) of DP-SGD runs that passed `_check_pld_cost`."""


def _guard_passed(shape: tuple[float, float, int], delta: float, neighboring: str) -> bool:
    """Whether a DP-SGD run with at least as much noise and at most as many steps passed the guard: the RDP
    ε of T Poisson-subsampled Gaussian steps grows with T and shrinks with σ (each order's RDP does, Mironov
    et al. 2019), so this one passes too. The per-epoch ε curve and σ calibration ask again and again."""
    q, sigma, steps = shape
    with _GUARD_LOCK:
        return any(s <= sigma and t >= steps for s, t in _GUARD_PASSED.get((q, delta, neighboring), ()))


@contextlib.contextmanager
def _quiet_rdp_warnings() -> Iterator[None]:
    """Hush dp-accounting's absl warnings while it computes.

    At small σ its RDP code logs "failed to converge ... Excluding this order" and drops that
    order: the bound stays valid (only looser), and the line would break the CLI's promise of
    clean output (one line on stderr for an error, none for a report). Thread-safe: the ε curve is
    computed in a background thread while the main thread may account too; the level is lowered by
    the first holder and restored by the last.
    """
    global _quiet_holders, _quiet_saved_level
    logger = logging.getLogger("absl")
    with _QUIET_LOCK:
        if _quiet_holders == 0:
            _quiet_saved_level = logger.level
            logger.setLevel(logging.ERROR)
        _quiet_holders += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_holders -= 1
            if _quiet_holders == 0:
                logger.setLevel(_quiet_saved_level)


_QUIET_LOCK = threading.Lock()
_quiet_holders = 0
_quiet_saved_level = logging.NOTSET


@contextlib.contextmanager
def _named_failures(accountant: str) -> Iterator[None]:
    """dp-accounting's failures (overflow, a refused value, memory) as one line naming the accountant."""
    try:
        yield
    except (ArithmeticError, ValueError, MemoryError) as exc:
        text = str(exc).strip().splitlines()
        raise DpltmUserError(f"the {ACCOUNTANTS[accountant].label} accountant failed at this setting: "
                             f"{text[0] if text else type(exc).__name__}") from None


def _refuse_early(event: DpEvent, accountant: str, neighboring: str, delta: float) -> None:
    """What is checked before the accountant computes: its support for `event`, and PLD's cost."""
    require_support(event, accountant, neighboring)
    if ACCOUNTANTS[accountant].cost_grows_with_epsilon:
        _check_pld_cost(event, delta, neighboring)


def _composed(event: DpEvent, accountant: str, neighboring: str, delta: float) -> PrivacyAccountant:
    """A fresh accountant that has composed `event`; dp-accounting's failures become one line."""
    _refuse_early(event, accountant, neighboring, delta)
    acc = make_accountant(accountant, neighboring)
    with _named_failures(accountant), _quiet_rdp_warnings():
        acc.compose(event)
    return acc


# ---- ε and δ ------------------------------------------------------------------------------


def _dpsgd_shape(event: DpEvent) -> tuple[float, float, int] | None:
    """(q, σ, T) where `event` is DP-SGD's T-fold self-composition of a Poisson-sampled Gaussian
    (nested self-compositions multiply), else None."""
    count = 1
    while isinstance(event, SelfComposedDpEvent):
        count *= int(event.count)
        event = event.event
    if (isinstance(event, PoissonSampledDpEvent) and isinstance(event.event, GaussianDpEvent)
            and event.sampling_probability > 0 and event.event.noise_multiplier > 0):
        return float(event.sampling_probability), float(event.event.noise_multiplier), count
    return None


class AccountantUnderflow(DpltmUserError):
    """An accountant's ε fell to 0 by underflow: no bound from it at this setting (another may give one)."""


@functools.lru_cache(maxsize=512)
def _epsilon_cached(key: str, delta: float, accountant: str, neighboring: str) -> float:
    event = event_from_json(json.loads(key))
    fast = getattr(ACCOUNTANTS[accountant].load(), "dpsgd_epsilon", None)
    shape = _dpsgd_shape(event) if fast is not None else None
    with _named_failures(accountant):
        if shape is not None:
            _refuse_early(event, accountant, neighboring, delta)
            return float(fast(*shape, delta, _RELATIONS[neighboring]))  # type: ignore[misc]
        acc = _composed(event, accountant, neighboring, delta)
        with _quiet_rdp_warnings():
            value = float(acc.get_epsilon(delta))
    if value <= 0.0 and '"GaussianDpEvent"' in key:
        # dp-accounting's RDP orders underflow to exactly 0 at very large σ (about 2e4 and more) and it then
        # reports ε = 0: not a bound for any finite σ (PLD gives a positive ε there)
        if accountant != "pld":
            raise AccountantUnderflow(f"the {ACCOUNTANTS[accountant].label} accountant underflows to epsilon 0 at "
                                      "this setting (a noise multiplier of about 1e4 or more, or a sampling rate "
                                      "so small that its privacy loss vanishes in floating point): it gives no "
                                      "bound here; use the PLD accountant (or, calibrating, a larger target "
                                      "epsilon)")
        # PLD's 0 is a true bound where δ is at least the whole privacy loss's mass, but states nothing useful
        raise AccountantUnderflow(f"the PLD accountant gives epsilon 0 at this setting (delta = {delta:g}, or a noise "
                                  "multiplier of about 1e4 or more): no meaningful guarantee to state or calibrate; "
                                  "use a smaller delta (usually well below 1/N) or a larger target epsilon")
    return value


def epsilon_unchecked(event: DpEvent, delta: float, accountant: str, neighboring: str) -> float:
    """`epsilon` for arguments already validated at the edge (the calibration search's inner loop).

    Support and cost are still checked, once per distinct event (the result is cached).
    """
    return _epsilon_cached(json.dumps(event_to_json(event), sort_keys=True), delta, accountant, neighboring)


def epsilon(
    event: DpEvent, delta: float, accountant: str = "pld", neighboring: str = "add_remove"
) -> float:
    """The ε for which `event` is (ε, δ)-DP, from the named dp-accounting accountant.

    An upper bound on the true ε for both accountants (module docstring). `math.inf` when
    the event contains a `NonPrivateDpEvent`. Cached on the event's JSON form, so ledgers
    and reports can ask repeatedly. The PLD accountant refuses (`EpsilonOutOfRange`) where
    the RDP bound exceeds `PLD_MAX_RDP_EPSILON`.
    """
    check_accountant(accountant)
    check_neighboring(neighboring)
    return epsilon_unchecked(event, check_delta(delta), accountant, neighboring)


def delta_for_epsilon(
    event: DpEvent, eps: float, accountant: str = "pld", neighboring: str = "add_remove"
) -> float:
    """The δ for which `event` is (eps, δ)-DP (1.0 when it contains a non-private event)."""
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise DpltmUserError(f"epsilon must be a finite number >= 0, got {eps}")
    check_accountant(accountant)
    check_neighboring(neighboring)
    acc = _composed(event, accountant, neighboring, _COST_REFERENCE_DELTA)
    with _named_failures(accountant), _quiet_rdp_warnings():
        return float(min(1.0, acc.get_delta(e)))


# ---- Gaussian DP (an approximation) -------------------------------------------------------


def gdp_mu(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """μ of the Gaussian-DP CLT for Poisson-subsampled DP-SGD: μ = q·√(T·(e^{1/σ²} − 1)).

    Bu, Dong, Long & Su (2020), Thm 5 with Poisson sampling (Dong, Roth & Su 2019 CLT).
    An APPROXIMATION: valid as T → ∞ with q√T fixed; see `gdp_epsilon`.
    """
    q = float(sample_rate)
    sigma = float(noise_multiplier)
    if not (0.0 < q <= 1.0):
        raise DpltmUserError(f"sample rate q must lie in (0, 1], got {sample_rate}")
    if not (math.isfinite(sigma) and sigma > 0.0):
        raise DpltmUserError(
            f"noise multiplier must be positive and finite, got {noise_multiplier}"
        )
    if isinstance(steps, bool) or int(steps) != steps or int(steps) < 0:
        raise DpltmUserError(f"steps must be a non-negative integer, got {steps}")
    try:
        growth = math.expm1(1.0 / (sigma * sigma))
    except OverflowError:
        return math.inf
    return q * math.sqrt(int(steps) * growth)


def gdp_delta(eps: float, mu: float) -> float:
    """δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) for μ-GDP (Dong, Roth & Su 2019, Cor. 2.13).

    The second term is evaluated as exp(ε + log Φ(·)) so it neither overflows nor loses
    precision at large ε.
    """
    if mu == 0.0:
        return 0.0
    a = -eps / mu + mu / 2.0
    b = -eps / mu - mu / 2.0
    return float(special.ndtr(a) - math.exp(eps + float(special.log_ndtr(b))))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which a μ-GDP mechanism is (ε, δ)-DP, solving `gdp_delta(ε, μ) = δ` (brentq).

    APPROXIMATION WARNING (docs/privacy.md §3, §5): with μ from `gdp_mu` this is the CLT
    approximation of Bu et al. (2020), not a bound. At the reference setting it gives 0.892
    where the (upper-bound) PLD accountant gives 0.900: it can fall BELOW the true ε
    (Opacus warns the same). Report it only labelled as an approximation; never use it
    as the default accountant or to calibrate σ without saying so.
    """
    m = float(mu)
    d = check_delta(delta)
    if math.isnan(m) or m < 0.0:
        raise DpltmUserError(f"mu must be >= 0, got {mu}")
    if m == math.inf:
        return math.inf
    if gdp_delta(0.0, m) <= d:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, m) > d:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(optimize.brentq(lambda e: gdp_delta(e, m) - d, 0.0, hi, xtol=1e-12, rtol=1e-12))


# ---- composing selection with training ----------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """One valid (ε, δ)-DP statement for the private part of a run, and how it was derived."""

    name: str
    epsilon: float
    delta: float
    accountant: str
    neighboring: str
    description: str


TRAINING_ONLY = "training-only"
BASIC_COMPOSITION = "basic-composition"
RDP_COMPOSITION = "rdp-composition"


def composition_bounds(
    selection_eps1: float | None,
    training_event: DpEvent,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
) -> list[Bound]:
    """Every valid (ε, δ) bound for selection (ε1-DP exponential mechanism) then training.

    * `selection_eps1` None (tickets and selection touch no private data, docs/privacy.md §1):
      the training bound alone, from the chosen accountant.
    * Basic composition (Dwork & Roth 2014, Thm 3.16): (ε1, 0)-DP then (ε2, δ)-DP is
      (ε1 + ε2, δ)-DP; ε2 from the chosen accountant. Always valid; the paper's Theorem 3.
    * RDP composition (Mironov 2017, Prop. 1): the selection as ε1²/8-zCDP (bounded range;
      Cesar & Rogers 2021) composed with training in the RDP accountant, converted at δ.
      Included whenever the RDP accountant supports the training event under
      `neighboring`; tighter than basic when training dominates.

    Use `best_bound` to pick the smallest.
    """
    check_accountant(accountant)
    check_neighboring(neighboring)
    d = check_delta(delta)
    label = ACCOUNTANTS[accountant].label
    eps_train = epsilon_unchecked(training_event, d, accountant, neighboring)
    if selection_eps1 is None:
        return [
            Bound(
                TRAINING_ONLY, eps_train, d, accountant, neighboring,
                f"training alone ({label} accountant); selection spent nothing on the private data",
            )
        ]
    sel = selection_event(selection_eps1)
    eps1 = float(selection_eps1)
    bounds = [
        Bound(
            BASIC_COMPOSITION, eps1 + eps_train, d, accountant, neighboring,
            f"basic composition ε1 + ε_train = {format_epsilon(eps1)} + {format_epsilon(eps_train)} "
            f"(Dwork & Roth 2014, Thm 3.16; ε_train by {label})",
        )
    ]
    composed = ComposedDpEvent([sel, training_event])
    if make_accountant("rdp", neighboring).supports(composed):
        bounds.append(
            Bound(
                RDP_COMPOSITION, epsilon_unchecked(composed, d, "rdp", neighboring), d, "rdp", neighboring,
                "RDP composition: selection as ε1²/8-zCDP (Cesar & Rogers 2021) + training "
                "(Mironov 2017)",
            )
        )
    return bounds


def best_bound(bounds: Sequence[Bound]) -> Bound:
    """The bound with the smallest ε (the first on ties): every one of them holds."""
    if not bounds:
        raise ValueError("no bounds to choose from")
    return min(bounds, key=lambda b: b.epsilon)
