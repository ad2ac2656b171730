"""ε from a real accountant, and every valid way to compose selection with training.

Two sound accountants from dp-accounting 0.6.0, both upper bounds on the true ε:

* ``"pld"`` — privacy loss distributions (Meiser & Mohammad 2018; Koskela, Jälkö & Honkela
  2020; Doroshenko et al. 2022 "connect the dots"). dp-accounting's `PLDAccountant` builds
  each PLD with `pessimistic_estimate=True`: losses are rounded up and the truncated tail
  is counted as infinite loss, so the ε it reports is an upper bound, and nearly tight.
  We use a value discretisation interval of 1e-4 (dp-accounting's default): at the
  reference setting of PRIVACY.md §3 it is within 5e-4 of the 1e-5 result, whereas 1e-3
  overstates ε = 0.180 as 0.216. Default accountant.
* ``"rdp"`` — Rényi DP (Mironov 2017; subsampled Gaussian per Mironov, Talwar & Zhang
  2019), converted to (ε, δ) by Canonne, Kamath & Steinke (2020), Prop. 12 (the same bound
  as Balle et al. 2020, Thm 21). Looser than PLD (about 10 % at the reference setting), but
  it also accepts `ZCDpEvent`, which is how the exponential mechanism enters an RDP
  composition.

The Gaussian-DP central limit theorem (Bu, Dong, Long & Su 2020) is offered separately as
a labelled *approximation* (`gdp_mu`, `gdp_epsilon`): it can fall below the true ε.

Neighbouring relation is explicit: ``"add_remove"`` (add/remove one record; default, what
Poisson sampling is analysed under) or ``"replace_one"``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dp_accounting import (  # type: ignore[import-untyped]
    ComposedDpEvent,
    NeighboringRelation,
    PrivacyAccountant,
    pld,
    rdp,
)
from scipy import optimize, special  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError
from dpltm.privacy.events import DpEvent, event_from_json, event_to_json, selection_event

ACCOUNTANTS = ("pld", "rdp")
NEIGHBORING = ("add_remove", "replace_one")

#: PLD value discretisation interval (see the module docstring for why 1e-4).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4

_RELATIONS = {
    "add_remove": NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": NeighboringRelation.REPLACE_ONE,
}

ACCOUNTANT_LABELS = {"pld": "PLD", "rdp": "RDP"}
NEIGHBORING_LABELS = {"add_remove": "add/remove-one", "replace_one": "replace-one"}


# ---- checks -------------------------------------------------------------------------------


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise DpltmUserError(f"unknown accountant {accountant!r}; choose one of {ACCOUNTANTS}")
    return accountant


def check_neighboring(neighboring: str) -> str:
    if neighboring not in NEIGHBORING:
        raise DpltmUserError(
            f"unknown neighbouring relation {neighboring!r}; choose one of {NEIGHBORING}"
        )
    return neighboring


def check_delta(delta: float) -> float:
    d = float(delta)
    if not (0.0 < d < 1.0):
        raise DpltmUserError(f"delta must lie strictly between 0 and 1, got {delta}")
    return d


def make_accountant(accountant: str = "pld", neighboring: str = "add_remove") -> PrivacyAccountant:
    """A fresh dp-accounting accountant of the named kind (see the module docstring)."""
    relation = _RELATIONS[check_neighboring(neighboring)]
    if check_accountant(accountant) == "pld":
        return pld.PLDAccountant(
            neighboring_relation=relation,
            value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
        )
    return rdp.RdpAccountant(neighboring_relation=relation)


def _offending_subevent(acc: PrivacyAccountant, event: DpEvent) -> DpEvent:
    """The innermost sub-event `acc` refuses, found with the side-effect-free `supports`."""
    if isinstance(event, ComposedDpEvent):
        for sub in event.events:
            if not acc.supports(sub):
                return _offending_subevent(acc, sub)
    inner = getattr(event, "event", None)
    if inner is not None and type(event).__name__ == "SelfComposedDpEvent":
        if not acc.supports(inner):
            return _offending_subevent(acc, inner)
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
            f"the {ACCOUNTANT_LABELS[accountant]} accountant cannot account for {bad} under "
            f"{NEIGHBORING_LABELS[neighboring]} adjacency; try another accountant or relation"
        )


# ---- ε and δ ------------------------------------------------------------------------------


def _key(event: DpEvent) -> str:
    return json.dumps(event_to_json(event), sort_keys=True)


@functools.lru_cache(maxsize=512)
def _epsilon_cached(key: str, delta: float, accountant: str, neighboring: str) -> float:
    event = event_from_json(json.loads(key))
    acc = make_accountant(accountant, neighboring)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def epsilon(
    event: DpEvent, delta: float, accountant: str = "pld", neighboring: str = "add_remove"
) -> float:
    """The ε for which `event` is (ε, δ)-DP, from the named dp-accounting accountant.

    An upper bound on the true ε for both accountants (module docstring). `math.inf` when
    the event contains a `NonPrivateDpEvent`. Cached on the event's JSON form, so ledgers
    and reports can ask repeatedly.
    """
    check_accountant(accountant)
    check_neighboring(neighboring)
    d = check_delta(delta)
    require_support(event, accountant, neighboring)
    return _epsilon_cached(_key(event), d, accountant, neighboring)


def delta_for_epsilon(
    event: DpEvent, eps: float, accountant: str = "pld", neighboring: str = "add_remove"
) -> float:
    """The δ for which `event` is (eps, δ)-DP (1.0 when it contains a non-private event)."""
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise DpltmUserError(f"epsilon must be a finite number >= 0, got {eps}")
    require_support(event, accountant, neighboring)
    acc = make_accountant(accountant, neighboring)
    acc.compose(event)
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

    APPROXIMATION WARNING (PRIVACY.md §3, §5): with μ from `gdp_mu` this is the CLT
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

    * `selection_eps1` None (tickets and selection touch no private data, PRIVACY.md §1):
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
    label = ACCOUNTANT_LABELS[accountant]
    eps_train = epsilon(training_event, d, accountant, neighboring)
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
            f"basic composition ε1 + ε_train = {eps1:g} + {eps_train:.4g} "
            f"(Dwork & Roth 2014, Thm 3.16; ε_train by {label})",
        )
    ]
    composed = ComposedDpEvent([sel, training_event])
    if make_accountant("rdp", neighboring).supports(composed):
        bounds.append(
            Bound(
                RDP_COMPOSITION, epsilon(composed, d, "rdp", neighboring), d, "rdp", neighboring,
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
