"""Choose the noise multiplier σ for a privacy budget.

Calibration takes a callback from parameter to `DpEvent`, as dp-accounting's
`mechanism_calibration.calibrate_dp_mechanism` does, and returns the smallest σ whose
*reported* ε does not exceed the target. The result is re-checked with the same accountant
and nudged up if discretisation made it overshoot, so ε(σ_returned) ≤ target always holds;
it is within `rel_tol` of the tightest such σ. (We run the root search ourselves rather
than through `calibrate_dp_mechanism` because that function re-evaluates its bracket and
root without caching, and one PLD evaluation at small σ takes seconds.)

For the PLD accountant the search starts from the RDP-calibrated σ, which costs little and
lies just above the PLD answer (RDP is the looser bound).

With a private selection (ε1 given), the reported ε is the best valid bound of
`accounting.composition_bounds`, so σ* is the smaller of the σ that meets the target by
basic composition (ε_train ≤ target − ε1) and the σ that meets it by RDP composition.

Bounded work: targets are at most `accounting.MAX_EPSILON`, σ is never sought below
`events.MIN_NOISE_MULTIPLIER` (if that already meets the target, it is the answer) nor above
1e6, and PLD is not run where RDP already puts ε beyond `accounting.PLD_MAX_RDP_EPSILON`
(such a σ simply misses the target). Arguments are validated once, by the public functions;
the search itself trusts them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import dp_accounting  # type: ignore[import-untyped]
from scipy import optimize  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import (
    EpsilonOutOfRange,
    check_accountant,
    check_delta,
    check_neighboring,
    check_target_epsilon,
    epsilon_unchecked,
    make_accountant,
    require_support,
)
from dpltm.privacy.display import format_epsilon, round_up
from dpltm.privacy.events import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER, DpEvent, dpsgd_event, selection_event

Composition = Literal["best", "basic", "rdp"]

#: Parameters beyond this are treated as "no bracket": the target is not reachable.
_MAX_PARAM = 1e6
_MIN_PARAM = 1e-3


def calibrate_parameter(
    make_event: Callable[[float], DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    initial_guess: float = 1.0,
    rel_tol: float = 1e-3,
    step: float = 2.0,
    lower: float = _MIN_PARAM,
) -> float:
    """The smallest x ≥ `lower` with ε(make_event(x)) ≤ target, for ε non-increasing in x (e.g. σ).

    The same contract as dp-accounting's `mechanism_calibration.calibrate_dp_mechanism`
    (a callback from parameter to event, a bracket, a root search, a final check that the
    returned parameter does not overshoot), but with every ε cached and the root sought in
    log-log space, where ε(σ) is close to a straight line, so Brent's method needs only a
    few evaluations (one PLD evaluation at σ < 1 takes about a second).

    Brackets the root by factors of `step` from `initial_guess`, then runs Brent's method
    on log ε(e^u) − log target to a relative tolerance `rel_tol` in x. Returns the upper
    end, verified: ε(x_returned) ≤ target always holds. Returns `lower` when it already
    meets the target. Arguments are validated here, once; the search trusts them.
    """
    t, d = _checked(target_epsilon, delta, accountant, neighboring, rel_tol)
    if not step > 1.0:
        raise DpltmUserError(f"step must exceed 1, got {step}")
    if not (math.isfinite(lower) and 0.0 < lower < _MAX_PARAM):
        raise DpltmUserError(f"lower must lie in (0, {_MAX_PARAM:g}), got {lower}")
    if not math.isfinite(initial_guess):
        raise DpltmUserError(f"initial_guess must be finite, got {initial_guess}")
    require_support(make_event(max(float(initial_guess), lower)), accountant, neighboring)
    return _search(make_event, t, d, accountant, neighboring, float(initial_guess), rel_tol, step, lower)


def _search(
    make_event: Callable[[float], DpEvent],
    t: float,
    d: float,
    accountant: str,
    neighboring: str,
    initial_guess: float,
    rel_tol: float,
    step: float,
    lower: float,
) -> float:
    """`calibrate_parameter`'s search, on validated arguments. At most ~60 bracket steps
    (from `lower` to `_MAX_PARAM` by factors of `step`), a bounded Brent search and bisection
    to `rel_tol`, and at most 100 final nudges: its work is bounded whatever the target."""

    def eps_at(value: float) -> float:
        try:
            return epsilon_unchecked(make_event(value), d, accountant, neighboring)
        except EpsilonOutOfRange:
            return math.inf  # far above any target (targets are at most MAX_EPSILON)

    x = min(max(initial_guess, lower), _MAX_PARAM)
    if eps_at(x) <= t:
        hi = x
        while True:
            if hi <= lower:
                return hi  # the smallest parameter allowed meets the target
            lo = max(hi / step, lower)
            if eps_at(lo) > t:
                break
            hi = lo
    else:
        lo, hi = x, x * step
        while (eps_hi := eps_at(hi)) > t:
            lo, hi = hi, hi * step
            if hi > _MAX_PARAM:
                raise DpltmUserError(
                    f"cannot reach epsilon {t:g} at delta {d:g}: even a noise parameter of "
                    f"{lo:g} gives epsilon {format_epsilon(eps_hi)} (raise --eps or --delta)"
                )
    # Invariant: ε(lo) > t >= ε(hi). ε(lo) may be infinite; then bisect in log space.
    log_t = math.log(t)

    def gap(u: float) -> float:
        e = eps_at(math.exp(u))
        return math.inf if e == math.inf else (math.log(e) - log_t if e > 0 else -math.inf)

    u_lo, u_hi = math.log(lo), math.log(hi)
    xtol = math.log1p(rel_tol) / 2.0
    if math.isfinite(gap(u_lo)) and math.isfinite(gap(u_hi)):
        try:
            root = float(optimize.brentq(gap, u_lo, u_hi, xtol=xtol, maxiter=100))
        except (ValueError, RuntimeError) as exc:
            raise DpltmUserError(f"calibration failed between {lo:g} and {hi:g}: {exc}") from None
        # Brent: the crossing lies within xtol of `root`. Keep the bracket verified on the
        # safe side (u_hi meets the target); u_lo only bounds how tight the answer is.
        if gap(root) <= 0.0:
            u_lo, u_hi = max(u_lo, root - 2.0 * xtol), root
        elif gap(root + xtol) <= 0.0:
            u_lo, u_hi = root, root + xtol
        else:
            u_lo = root
    while u_hi - u_lo > 2.0 * xtol:
        mid = 0.5 * (u_lo + u_hi)
        if gap(mid) <= 0.0:
            u_hi = mid
        else:
            u_lo = mid
    result = math.exp(u_hi)
    for _ in range(100):  # guard against ε that is not quite monotone (discretisation)
        if eps_at(result) <= t:
            return result
        result *= 1.0 + rel_tol
    raise DpltmUserError(f"calibration could not meet epsilon {t:g}; last parameter {result:g}")


def _calibrate(
    make_event: Callable[[float], DpEvent],
    target: float,
    delta: float,
    accountant: str,
    neighboring: str,
    rel_tol: float,
) -> float:
    """`calibrate_parameter`, started for PLD from the (cheap) RDP answer.

    RDP's ε is the larger, so its σ lies a little above PLD's (about 7 % at the reference
    setting of docs/privacy.md §3): a bracket of ±25 % around it costs two PLD evaluations.
    """
    lower = MIN_NOISE_MULTIPLIER
    rdp_supported = make_accountant("rdp", neighboring).supports(make_event(1.0))
    if accountant != "pld" or not rdp_supported:
        require_support(make_event(1.0), accountant, neighboring)
        return _search(make_event, target, delta, accountant, neighboring, 1.0, rel_tol, 2.0, lower)
    try:
        guess = _search(make_event, target, delta, "rdp", neighboring, 1.0, 1e-2, 2.0, lower)
    except DpltmUserError:
        # RDP cannot reach the target at any σ, e.g. when part of the event (a private ticket's
        # warm-up) has a fixed σ and RDP's looser bound for it alone exceeds the target: PLD may
        # still reach it, so search with PLD from scratch.
        require_support(make_event(1.0), "pld", neighboring)
        return _search(make_event, target, delta, "pld", neighboring, 1.0, rel_tol, 2.0, lower)
    require_support(make_event(guess), "pld", neighboring)
    return _search(make_event, target, delta, "pld", neighboring, guess, rel_tol, 1.25, lower)


def calibrate_noise_multiplier(
    sample_rate: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    selection_eps1: float | None = None,
    composition: Composition = "best",
    rel_tol: float = 1e-3,
    spent: Sequence[DpEvent] = (),
) -> float:
    """The smallest σ ≥ MIN_NOISE_MULTIPLIER (within `rel_tol`) for which DP-SGD meets
    (target_epsilon, delta).

    * `selection_eps1` None: ε_train(σ) ≤ target with the chosen accountant.
    * `selection_eps1` given, `composition`:
      - "basic": ε1 + ε_train(σ) ≤ target (Dwork & Roth 2014, Thm 3.16);
      - "rdp": RDP ε of [ε1²/8-zCDP selection, training] ≤ target (Cesar & Rogers 2021;
        Mironov 2017), with the RDP accountant whatever `accountant` says;
      - "best" (default): the smaller σ of the two, i.e. exactly the σ at which
        `composition_bounds(...)`'s best bound reaches the target.
    * `spent` given (DP events already run on the same data, e.g. the DP warm-up of a private
      ticket, or a library run's earlier segments): `spent` composed with DP-SGD(q, σ, T) meets the
      target. Adaptive composition (Dwork & Roth 2014, Thm 3.16) lets the later mechanism depend on
      the earlier ones' outputs; the accountant composes the events exactly (PLD) or by RDP. With a
      `selection_eps1` too, the selection is composed in as above (basic, RDP, or the smaller σ).

    Raises DpltmUserError when the target cannot be met (e.g. target ≤ 0 or above
    MAX_EPSILON, or selection or `spent` alone already costs at least the target).
    """
    t, d = _checked(target_epsilon, delta, accountant, neighboring, rel_tol)
    dpsgd_event(sample_rate, 1.0, steps)  # validates q and steps
    if spent and selection_eps1 is not None:
        sigma = _calibrated_with_selection(list(spent), float(sample_rate), int(steps), t, d, accountant,
                                           neighboring, float(selection_eps1), composition, float(rel_tol))
    elif spent:
        sigma = _calibrated_after(list(spent), float(sample_rate), int(steps), t, d, accountant, neighboring,
                                  float(rel_tol))
    else:
        sigma = _calibrated_dpsgd(float(sample_rate), int(steps), t, d, accountant, neighboring,
                                  None if selection_eps1 is None else float(selection_eps1), composition,
                                  float(rel_tol))
    if sigma > MAX_NOISE_MULTIPLIER:  # the bound a given σ has: past it the accountants cannot state the tiny ε
        raise DpltmUserError(f"target epsilon {t:g} needs a noise multiplier of {round_up(sigma, 4)}, above the "
                             f"{MAX_NOISE_MULTIPLIER:g} the accountants can state ε for (and noise that drowns any "
                             "gradient): raise the target epsilon")
    return sigma


@functools.lru_cache(maxsize=256)
def _calibrated_dpsgd(sample_rate: float, steps: int, t: float, d: float, accountant: str, neighboring: str,
                      selection_eps1: float | None, composition: Composition, rel_tol: float) -> float:
    """`calibrate_noise_multiplier` on checked arguments. A pure function of them (dp-accounting is
    deterministic), so it is cached: the plan check, the noise-aware choice and the training of one
    `dpltm run` calibrate the same plan once (a failed search raises and is not cached)."""

    def training(sigma: float) -> DpEvent:
        return dpsgd_event(sample_rate, sigma, steps)

    if selection_eps1 is None:
        return _calibrate(training, t, d, accountant, neighboring, rel_tol)
    return _calibrated_with_selection([], sample_rate, steps, t, d, accountant, neighboring, float(selection_eps1),
                                      composition, rel_tol)


def _calibrated_after(spent: list[DpEvent], sample_rate: float, steps: int, t: float, d: float, accountant: str,
                      neighboring: str, rel_tol: float) -> float:
    """`calibrate_noise_multiplier` after `spent`, on checked arguments."""
    floor = epsilon_unchecked(dp_accounting.ComposedDpEvent(spent), d, accountant, neighboring)
    if floor >= t:
        raise DpltmUserError(f"cannot reach epsilon {t:g}: what already ran on this data costs epsilon "
                             f"{format_epsilon(floor)}")

    def both(sigma: float) -> DpEvent:
        return dp_accounting.ComposedDpEvent([*spent, dpsgd_event(sample_rate, sigma, steps)])

    return _calibrate(both, t, d, accountant, neighboring, rel_tol)


def _calibrated_with_selection(spent: list[DpEvent], sample_rate: float, steps: int, t: float, d: float,
                               accountant: str, neighboring: str, eps1: float, composition: Composition,
                               rel_tol: float) -> float:
    """With a selection's ε1 (after `spent`, if any): the smaller σ of the two bounds the ledger takes the best of
    (`accounting.composition_bounds`): basic, ε1 + the accountant's ε of `spent` and training ≤ t; RDP, the
    ε1²/8-zCDP selection composed with `spent` and training ≤ t."""
    if composition not in ("best", "basic", "rdp"):
        raise DpltmUserError(f"unknown composition {composition!r}; choose best, basic or rdp")
    sel = selection_event(eps1)  # validates ε1

    def training(sigma: float) -> DpEvent:
        return dpsgd_event(sample_rate, sigma, steps)

    def everything(sigma: float) -> DpEvent:
        return dp_accounting.ComposedDpEvent([sel, *spent, training(sigma)])

    candidates: list[float] = []
    reasons: list[str] = []
    if composition in ("best", "basic"):
        if eps1 >= t:
            reasons.append(f"basic composition needs eps1 ({eps1:g}) below the target")
        elif not spent:
            candidates.append(_calibrate(training, t - eps1, d, accountant, neighboring, rel_tol))
        else:
            try:
                candidates.append(_calibrated_after(spent, sample_rate, steps, t - eps1, d, accountant, neighboring,
                                                    rel_tol))
            except DpltmUserError as refused:
                reasons.append(str(refused))
    if composition in ("best", "rdp") and make_accountant("rdp", neighboring).supports(everything(1.0)):
        floor = epsilon_unchecked(dp_accounting.ComposedDpEvent([sel, *spent]) if spent else sel, d, "rdp",
                                  neighboring)
        if floor < t:
            candidates.append(_calibrate(everything, t, d, "rdp", neighboring, rel_tol))
        else:
            reasons.append(f"the selection {'and what already ran cost' if spent else 'alone costs'} epsilon "
                           f"{format_epsilon(floor)} by RDP")
    elif composition == "rdp":
        reasons.append("the RDP accountant does not support this training event")
    if not candidates:
        raise DpltmUserError(f"cannot reach epsilon {t:g} with selection eps1 {eps1:g}"
                             + (" after what already ran: " if spent else ": ") + "; ".join(reasons))
    return min(candidates)


def calibrate_phases(
    phases: list[tuple[float, int]],
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    rel_tol: float = 1e-3,
) -> float:
    """The smallest σ, shared by every DP-SGD phase (q_i, T_i) on the same data, for which their
    composition meets (target_epsilon, delta): how a private-ticket run (warm-up rounds, then
    training) is planned before any private record is read."""
    t, d = _checked(target_epsilon, delta, accountant, neighboring, rel_tol)
    if not phases:
        raise DpltmUserError("no DP-SGD phase to calibrate")
    for q, steps in phases:
        dpsgd_event(q, 1.0, steps)
    return _calibrated_phases(tuple((float(q), int(steps)) for q, steps in phases), t, d, accountant, neighboring,
                              float(rel_tol))


@functools.lru_cache(maxsize=64)
def _calibrated_phases(phases: tuple[tuple[float, int], ...], t: float, d: float, accountant: str,
                       neighboring: str, rel_tol: float) -> float:
    """`calibrate_phases` on checked arguments; pure, so cached like `_calibrated_dpsgd`: `dpltm run
    --ticket-source private` plans the same phases in its check, its warm-up and its training."""

    def all_phases(sigma: float) -> DpEvent:
        return dp_accounting.ComposedDpEvent([dpsgd_event(q, sigma, steps) for q, steps in phases])

    return _calibrate(all_phases, t, d, accountant, neighboring, rel_tol)


def _checked(target_epsilon: float, delta: float, accountant: str, neighboring: str,
             rel_tol: float) -> tuple[float, float]:
    """The validation every public calibration starts with: (target ε, δ), both checked."""
    check_accountant(accountant)
    check_neighboring(neighboring)
    if not (0.0 < rel_tol < 0.5):
        raise DpltmUserError(f"rel_tol must lie in (0, 0.5), got {rel_tol}")
    return check_target_epsilon(target_epsilon), check_delta(delta)
