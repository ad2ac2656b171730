"""Privacy loss distributions (Meiser & Mohammad 2018; Koskela, Jälkö & Honkela 2020; Doroshenko et al. 2022
"connect the dots"): dpltm's default accountant.

dp-accounting's `PLDAccountant` builds each PLD with `pessimistic_estimate=True`: losses are rounded up
and the truncated tail is counted as infinite loss, so the ε it reports is an upper bound, and nearly
tight. The value discretisation interval is 1e-4 (dp-accounting's default): at the reference setting of
docs/privacy.md §3 it is within 5e-4 of the 1e-5 result, whereas 1e-3 overstates ε = 0.180 as 0.216.
"""

from __future__ import annotations

import functools
from typing import Any

from dp_accounting import NeighboringRelation, PrivacyAccountant, pld  # type: ignore[import-untyped]
from dp_accounting.pld import privacy_loss_distribution as pld_lib  # type: ignore[import-untyped]

PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4


def make(relation: NeighboringRelation) -> PrivacyAccountant:
    return pld.PLDAccountant(neighboring_relation=relation,
                             value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)


@functools.lru_cache(maxsize=4)  # a run asks for one (q, σ); a σ search's many each once (up to ~12 MB each)
def _subsampled_gaussian_pld(q: float, sigma: float, relation: NeighboringRelation) -> Any:
    """The one-step PLD of a Poisson-sampled Gaussian, exactly as `PLDAccountant` builds it (pessimistic,
    connect-the-dots, our discretisation), kept for reuse.

    Building it is most of a DP-SGD ε query (~0.3 s of ~0.45 s); the ε after each epoch, the budget
    stop and the final report all self-compose this same PLD a different number of times
    (`PrivacyLossDistribution.self_compose` returns a new PLD and leaves this one unchanged).
    """
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
        sampling_prob=q, neighboring_relation=relation)


def dpsgd_epsilon(q: float, sigma: float, steps: int, delta: float, relation: NeighboringRelation) -> float:
    """What `PLDAccountant` computes for DP-SGD's event (identity ∘ one-step PLD^T, then ε at δ), bit for
    bit, from the cached one-step PLD (tests/privacy/test_accounting.py checks the equality)."""
    composed = pld_lib.identity(PLD_VALUE_DISCRETIZATION_INTERVAL).compose(
        _subsampled_gaussian_pld(q, sigma, relation).self_compose(steps))
    return float(composed.get_epsilon_for_delta(delta))
