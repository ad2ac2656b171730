"""Other papers' own privacy accounting, reproduced as LABELLED COMPARISONS only.

Nothing here is ever used for a guarantee, to calibrate noise, or in a ledger: dpltm's ε
always comes from the sound PLD/RDP accountants (dpltm.privacy.accounting) applied to the
effective Gaussian multiplier of the noise plug-in (docs/privacy.md §4). These functions exist so
that a user can see what a paper would have claimed for the same run, and how far that is
from a valid bound.

Differentially Private Dropout (Ermiş & Cemgil; shared/papers/000_53eedf11a90bd2cc.txt)
-----------------------------------------------------------------------------------------
The paper adds N(0, 4C²σ²) to the clipped gradient (Alg. 1), i.e. noise std 2Cσ for an L2
sensitivity Δ = 2C (its replace-one reading), and accounts for it in §4.3–4.4 by two routes,
both of which go through the classical (ε, δ) Gaussian mechanism and Li et al.'s subsampling
lemma for EACH iteration:

1. Theorem 2 (Dwork & Roth 2014, Thm A.1): the Gaussian mechanism with noise std
   σ·Δ is (ε_iter, δ_iter)-DP for ε_iter = √(2 ln(1.25/δ_iter)) / σ on the sampled subset.
2. Theorem 3 (Li, Qardaji & Su 2012, Thm 1): Poisson subsampling with rate ν turns that into
   (ε', δ') = (ln(1 + ν(e^{ε_iter} − 1)), ν·δ_iter) per iteration (eq. 7).

DPD-zCDP (eq. 6): treat the subsampled step as a Gaussian mechanism calibrated to (ε', δ'),
τ = 2 ln(1.25/δ')Δ²/ε'², which by Bun & Steinke (2016) Prop. 1.6 is ρ' = Δ²/(2τ)
= ε'²/(4 ln(1.25/δ'))-zCDP; compose J times (Lemma 1.7: ρ = J·ρ'), and convert with
Prop. 1.3: ε_tot = ρ + 2√(ρ ln(1/δ_tot)).

DPD-AC (§4.3): advanced composition (Dwork & Roth 2014, Thm 3.20) of J such steps with the
paper's first-order form ε_tot = √(2J ln(1/δ'')) ε' + J ε'², δ_tot = J·ν·δ_iter + δ''.
(The paper prints "/σ'" for the first term; the composition theorem multiplies by the
per-step ε, which is what we do.)

What the paper leaves open, and the reading that reproduces its figures. The per-iteration δ
and the number of compositions J are not pinned down. Its MNIST settings are N = 60000,
S = 600 (ν = 0.01), E = 200 epochs, so T = E/ν = 20000 iterations, δ = 1e-4, and it reports
σ = 3.23 (zCDP) and σ = 10.88 (AC) "for ε = 0.5". With δ_iter = δ/T (δ spread over the T
iterations; AC: δ'' = δ/2) these come out as 3.248 and 10.80 — within 1 % — only when the
composition runs over J = E = 200 *data passes* (Alg. 1's loop variable is "number of data
passes T"), not over the 20000 iterations actually run; composed over 20000 iterations the
same formulas give σ = 13.9 (zCDP) and σ = 83.3 (AC). `paper_compositions` returns the
paper's J. The printed figure understates ε: by the sound accountants σ = 3.23 at these
settings is ε ≈ 0.67 (PLD) / ≈ 0.75 (RDP) under add/remove (effective multiplier 2σ,
docs/privacy.md §4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import optimize  # type: ignore[import-untyped]

from dpltm.errors import DpltmUserError

#: What every number from this module is, in words a report can print beside it.
COMPARISON_LABEL = "COMPARISON ONLY (the DPD paper's own accounting; not a bound)"


def _check(sigma: float, sample_rate: float, compositions: float, delta: float) -> None:
    if not (math.isfinite(sigma) and sigma > 0):
        raise DpltmUserError(f"σ must be positive and finite, got {sigma}")
    if not 0 < sample_rate <= 1:
        raise DpltmUserError(f"sample rate must lie in (0, 1], got {sample_rate}")
    if not compositions > 0:
        raise DpltmUserError(f"number of compositions must be positive, got {compositions}")
    if not 0 < delta < 1:
        raise DpltmUserError(f"δ must lie in (0, 1), got {delta}")


def paper_compositions(sample_rate: float, steps: int) -> float:
    """J as the DPD paper's figures use it: E = ν·T data passes, not the T iterations run."""
    return sample_rate * steps


def _per_iteration(sigma: float, sample_rate: float, delta_iter: float) -> tuple[float, float]:
    """(ε', δ') of one subsampled step: Thm 2 (classical Gaussian), then Thm 3 (Li et al.)."""
    if not 0 < delta_iter < 1:
        raise DpltmUserError(f"per-iteration δ must lie in (0, 1), got {delta_iter}")
    eps_iter = math.sqrt(2.0 * math.log(1.25 / delta_iter)) / sigma
    eps_step = math.log1p(sample_rate * math.expm1(eps_iter)) if eps_iter < 700 else math.inf
    return eps_step, sample_rate * delta_iter


def dpd_paper_zcdp_epsilon(sigma: float, sample_rate: float, compositions: float, delta: float,
                           delta_iter: float) -> float:
    """ε by the DPD paper's zCDP route (§4.4, eqs. 6–7). COMPARISON ONLY, not a bound.

    `sigma` is the paper's σ (noise std 2Cσ, sensitivity 2C); `compositions` is J (see
    `paper_compositions`); `delta_iter` the per-iteration δ of Thm 2 (module docstring:
    δ/T reproduces the paper's figures).
    """
    _check(sigma, sample_rate, compositions, delta)
    eps_step, delta_step = _per_iteration(sigma, sample_rate, delta_iter)
    rho = compositions * eps_step**2 / (4.0 * math.log(1.25 / delta_step))  # Prop. 1.6 + Lemma 1.7
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))  # Prop. 1.3


def dpd_paper_ac_epsilon(sigma: float, sample_rate: float, compositions: float, delta: float,
                         delta_iter: float, delta_composition: float) -> float:
    """ε by the DPD paper's advanced-composition route (DPD-AC, §4.3). COMPARISON ONLY.

    ε_tot = √(2J ln(1/δ'')) ε' + J ε'² (the paper's first-order form of Dwork & Roth 2014,
    Thm 3.20) with ε' the subsampled per-step ε; `delta_composition` is δ''.
    """
    _check(sigma, sample_rate, compositions, delta)
    if not 0 < delta_composition < delta:
        raise DpltmUserError(f"δ'' must lie in (0, δ), got {delta_composition}")
    eps_step, _ = _per_iteration(sigma, sample_rate, delta_iter)
    return math.sqrt(2.0 * compositions * math.log(1.0 / delta_composition)) * eps_step + compositions * eps_step**2


@dataclass(frozen=True)
class DpdPaperFigure:
    """One figure of the DPD paper's accounting for a run, with how it was obtained."""

    route: str  # "zcdp" | "ac"
    sigma: float
    epsilon: float
    delta: float
    compositions: float
    delta_iter: float
    label: str = COMPARISON_LABEL


def dpd_paper_figure(sigma: float, sample_rate: float, steps: int, delta: float, route: str = "zcdp",
                     compositions: float | None = None) -> DpdPaperFigure:
    """The paper's ε for DPD σ run for `steps` Poisson steps at rate q, read as in the module
    docstring: J = q·steps data passes (unless `compositions` is given), δ_iter = δ/steps,
    and for AC δ'' = δ/2. COMPARISON ONLY."""
    j = paper_compositions(sample_rate, steps) if compositions is None else compositions
    delta_iter = delta / steps
    if route == "zcdp":
        eps = dpd_paper_zcdp_epsilon(sigma, sample_rate, j, delta, delta_iter)
    elif route == "ac":
        eps = dpd_paper_ac_epsilon(sigma, sample_rate, j, delta, delta_iter, delta / 2.0)
    else:
        raise DpltmUserError(f"unknown DPD paper route {route!r}; choose zcdp or ac")
    return DpdPaperFigure(route, sigma, eps, delta, j, delta_iter)


def dpd_paper_sigma(target_epsilon: float, sample_rate: float, steps: int, delta: float, route: str = "zcdp",
                    compositions: float | None = None) -> float:
    """The σ the DPD paper's accounting would pick for `target_epsilon` (inverse of
    `dpd_paper_figure`, by bisection; ε is decreasing in σ). COMPARISON ONLY."""
    if not target_epsilon > 0:
        raise DpltmUserError(f"target ε must be positive, got {target_epsilon}")

    def gap(log_sigma: float) -> float:
        return dpd_paper_figure(math.exp(log_sigma), sample_rate, steps, delta, route, compositions).epsilon \
            - target_epsilon

    lo, hi = math.log(1e-2), math.log(1e6)
    if gap(lo) < 0 or gap(hi) > 0:
        raise DpltmUserError(f"no σ in [1e-2, 1e6] meets ε = {target_epsilon:g} by the DPD paper's route")
    return math.exp(float(optimize.brentq(gap, lo, hi, xtol=1e-12, rtol=1e-12)))
