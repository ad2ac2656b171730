"""Rényi DP (Mironov 2017; the Poisson-subsampled Gaussian per Mironov, Talwar & Zhang 2019), converted to
(ε, δ) by Canonne, Kamath & Steinke (2020), Prop. 12 (the bound of Balle et al. 2020, Thm 21). Looser than
PLD (about 10 % at docs/privacy.md §3's reference setting), but it also composes `ZCDpEvent`, which is how
the exponential mechanism enters a composition (dpltm.privacy.accounting.composition_bounds)."""

from __future__ import annotations

from dp_accounting import NeighboringRelation, PrivacyAccountant, rdp  # type: ignore[import-untyped]


def make(relation: NeighboringRelation) -> PrivacyAccountant:
    return rdp.RdpAccountant(neighboring_relation=relation)
