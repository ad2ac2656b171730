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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import dp_accounting  # type: ignore[import-untyped]
from scipy import optimize  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import (
    check_accountant,
    check_delta,
    check_neighboring,
    epsilon,
    make_accountant,
    require_support,
)
from dpltm.privacy.events import DpEvent, dpsgd_event, selection_event

Composition = Literal["best", "basic", "rdp"]

#: Parameters beyond this are treated as "no bracket": the target is not reachable.
_MAX_PARAM = 1e6
_MIN_PARAM = 1e-3


def _check_target(target_epsilon: float) -> float:
    t = float(target_epsilon)
    if not (math.isfinite(t) and t > 0.0):
        raise DpltmUserError(
            f"target epsilon must be a positive finite number, got {target_epsilon}"
        )
    return t


def calibrate_parameter(
    make_event: Callable[[float], DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_remove",
    initial_guess: float = 1.0,
    rel_tol: float = 1e-3,
    step: float = 2.0,
) -> float:
    """The smallest x with ε(make_event(x)) ≤ target, for ε non-increasing in x (e.g. σ).

    The same contract as dp-accounting's `mechanism_calibration.calibrate_dp_mechanism`
    (a callback from parameter to event, a bracket, a root search, a final check that the
    returned parameter does not overshoot), but with every ε cached and the root sought in
    log-log space, where ε(σ) is close to a straight line, so Brent's method needs only a
    few evaluations (one PLD evaluation at σ < 1 takes about a second).

    Brackets the root by factors of `step` from `initial_guess`, then runs Brent's method
    on log ε(e^u) − log target to a relative tolerance `rel_tol` in x. Returns the upper
    end, verified: ε(x_returned) ≤ target always holds.
    """
    check_accountant(accountant)
    check_neighboring(neighboring)
    d = check_delta(delta)
    t = _check_target(target_epsilon)
    if not (0.0 < rel_tol < 0.5):
        raise DpltmUserError(f"rel_tol must lie in (0, 0.5), got {rel_tol}")
    if not step > 1.0:
        raise DpltmUserError(f"step must exceed 1, got {step}")
    x = min(max(float(initial_guess), _MIN_PARAM), _MAX_PARAM)
    require_support(make_event(x), accountant, neighboring)

    def eps_at(value: float) -> float:
        return epsilon(make_event(value), d, accountant, neighboring)

    if eps_at(x) <= t:
        hi, lo = x, x / step
        while eps_at(lo) <= t:
            hi, lo = lo, lo / step
            if lo < _MIN_PARAM:
                return hi  # anything this small meets the target; no need to be tighter
    else:
        lo, hi = x, x * step
        while eps_at(hi) > t:
            lo, hi = hi, hi * step
            if hi > _MAX_PARAM:
                raise DpltmUserError(
                    f"cannot reach epsilon {t:g} at delta {d:g}: even a parameter of "
                    f"{_MAX_PARAM:g} gives epsilon {eps_at(hi):.4g}"
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
            root = float(optimize.brentq(gap, u_lo, u_hi, xtol=xtol))
        except ValueError as exc:
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
    setting of PRIVACY.md §3): a bracket of ±25 % around it costs two PLD evaluations.
    """
    rdp_supported = make_accountant("rdp", neighboring).supports(make_event(1.0))
    if accountant != "pld" or not rdp_supported:
        return calibrate_parameter(make_event, target, delta, accountant, neighboring,
                                   rel_tol=rel_tol)
    guess = calibrate_parameter(make_event, target, delta, "rdp", neighboring, rel_tol=1e-2)
    return calibrate_parameter(make_event, target, delta, "pld", neighboring,
                               initial_guess=guess, rel_tol=rel_tol, step=1.25)


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
) -> float:
    """The smallest σ (within `rel_tol`) for which DP-SGD meets (target_epsilon, delta).

    * `selection_eps1` None: ε_train(σ) ≤ target with the chosen accountant.
    * `selection_eps1` given, `composition`:
      - "basic": ε1 + ε_train(σ) ≤ target (Dwork & Roth 2014, Thm 3.16);
      - "rdp": RDP ε of [ε1²/8-zCDP selection, training] ≤ target (Cesar & Rogers 2021;
        Mironov 2017), with the RDP accountant whatever `accountant` says;
      - "best" (default): the smaller σ of the two, i.e. exactly the σ at which
        `composition_bounds(...)`'s best bound reaches the target.

    Raises DpltmUserError when the target cannot be met (e.g. target ≤ 0, or selection
    alone already costs at least the target).
    """
    t = _check_target(target_epsilon)
    d = check_delta(delta)
    dpsgd_event(sample_rate, 1.0, steps)  # validates q and steps

    def training(sigma: float) -> DpEvent:
        return dpsgd_event(sample_rate, sigma, steps)

    if selection_eps1 is None:
        return _calibrate(training, t, d, accountant, neighboring, rel_tol)
    if composition not in ("best", "basic", "rdp"):
        raise DpltmUserError(f"unknown composition {composition!r}; choose best, basic or rdp")
    eps1 = float(selection_eps1)
    sel = selection_event(eps1)
    candidates: list[float] = []
    reasons: list[str] = []
    if composition in ("best", "basic"):
        if eps1 < t:
            candidates.append(_calibrate(training, t - eps1, d, accountant, neighboring, rel_tol))
        else:
            reasons.append(f"basic composition needs eps1 ({eps1:g}) below the target")
    rdp_ok = make_accountant("rdp", neighboring).supports(
        dp_accounting.ComposedDpEvent([sel, training(1.0)])
    )
    if composition in ("best", "rdp") and rdp_ok:
        floor = epsilon(sel, d, "rdp", neighboring)
        if floor < t:
            def both(sigma: float) -> DpEvent:
                return dp_accounting.ComposedDpEvent([sel, training(sigma)])

            candidates.append(_calibrate(both, t, d, "rdp", neighboring, rel_tol))
        else:
            reasons.append(f"the selection alone costs epsilon {floor:.4g} by RDP")
    elif composition == "rdp":
        reasons.append("the RDP accountant does not support this training event")
    if not candidates:
        raise DpltmUserError(f"cannot reach epsilon {t:g} with selection eps1 {eps1:g}: "
                             + "; ".join(reasons))
    return min(candidates)
