"""Choose the noise multiplier σ for a privacy budget.

Calibration takes a callback from parameter to `DpEvent` (dp-accounting's
`mechanism_calibration.calibrate_dp_mechanism`, which we use for the root search) and
returns the smallest σ whose *reported* ε does not exceed the target. The result is then
re-checked with the same accountant and nudged up if discretisation made it overshoot, so
ε(σ_returned) ≤ target always holds; it is within `rel_tol` of the tightest such σ.

With a private selection (ε1 given), the reported ε is the best valid bound of
`accounting.composition_bounds`, so σ* is the smaller of the σ that meets the target by
basic composition (ε_train ≤ target − ε1) and the σ that meets it by RDP composition.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import dp_accounting  # type: ignore[import-untyped]
from dp_accounting import mechanism_calibration

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
) -> float:
    """The smallest x with ε(make_event(x)) ≤ target, for ε non-increasing in x (e.g. σ).

    Brackets the root by factors of 2 from `initial_guess` (never evaluating far below the
    answer, where a PLD for a huge ε would be expensive), then hands the bracket to
    dp-accounting's `calibrate_dp_mechanism` with absolute tolerance `rel_tol`·(lower end),
    which is at most `rel_tol` relative to the answer. Finally verifies and, if needed,
    steps x up by (1 + rel_tol) until ε(x) ≤ target.
    """
    check_accountant(accountant)
    check_neighboring(neighboring)
    d = check_delta(delta)
    t = _check_target(target_epsilon)
    if not (0.0 < rel_tol < 0.5):
        raise DpltmUserError(f"rel_tol must lie in (0, 0.5), got {rel_tol}")
    require_support(make_event(max(initial_guess, _MIN_PARAM)), accountant, neighboring)

    def eps_at(x: float) -> float:
        return epsilon(make_event(x), d, accountant, neighboring)

    x = max(float(initial_guess), _MIN_PARAM)
    if eps_at(x) <= t:
        hi = x
        lo = x / 2.0
        while eps_at(lo) <= t:
            hi, lo = lo, lo / 2.0
            if lo < _MIN_PARAM:
                return hi  # anything this small meets the target; no need to be tighter
    else:
        lo = x
        hi = 2.0 * x
        while eps_at(hi) > t:
            lo, hi = hi, 2.0 * hi
            if hi > _MAX_PARAM:
                raise DpltmUserError(
                    f"cannot reach epsilon {t:g} at delta {d:g}: even a parameter of "
                    f"{_MAX_PARAM:g} gives epsilon {eps_at(hi):.4g}"
                )
    try:
        root = float(
            mechanism_calibration.calibrate_dp_mechanism(
                lambda: make_accountant(accountant, neighboring),
                make_event,
                t,
                d,
                bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
                tol=rel_tol * lo,
            )
        )
    except (ValueError, mechanism_calibration.NoBracketIntervalFoundError) as exc:
        raise DpltmUserError(f"calibration failed between {lo:g} and {hi:g}: {exc}") from None
    for _ in range(100):
        if eps_at(root) <= t:
            return root
        root *= 1.0 + rel_tol
    raise DpltmUserError(f"calibration could not meet epsilon {t:g}; last parameter {root:g}")


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
        return calibrate_parameter(training, t, d, accountant, neighboring, rel_tol=rel_tol)
    if composition not in ("best", "basic", "rdp"):
        raise DpltmUserError(f"unknown composition {composition!r}; choose best, basic or rdp")
    eps1 = float(selection_eps1)
    sel = selection_event(eps1)
    candidates: list[float] = []
    reasons: list[str] = []
    if composition in ("best", "basic"):
        if eps1 < t:
            candidates.append(
                calibrate_parameter(training, t - eps1, d, accountant, neighboring, rel_tol=rel_tol)
            )
        else:
            reasons.append(f"basic composition needs eps1 ({eps1:g}) below the target")
    rdp_ok = make_accountant("rdp", neighboring).supports(
        dp_accounting.ComposedDpEvent([sel, training(1.0)])
    )
    if composition in ("best", "rdp") and rdp_ok:
        floor = epsilon(sel, d, "rdp", neighboring)
        if floor < t:
            guess = candidates[0] if candidates else 1.0

            def both(sigma: float) -> DpEvent:
                return dp_accounting.ComposedDpEvent([sel, training(sigma)])

            candidates.append(
                calibrate_parameter(both, t, d, "rdp", neighboring, initial_guess=guess,
                                    rel_tol=rel_tol)
            )
        else:
            reasons.append(f"the selection alone costs epsilon {floor:.4g} by RDP")
    elif composition == "rdp":
        reasons.append("the RDP accountant does not support this training event")
    if not candidates:
        raise DpltmUserError(f"cannot reach epsilon {t:g} with selection eps1 {eps1:g}: "
                             + "; ".join(reasons))
    return min(candidates)
