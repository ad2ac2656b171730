"""From an attack's guesses to a lower bound on ε (Steinke, Nasr & Jagielski, NeurIPS 2023).

m canaries, each included in the training set independently with probability 1/2. The attack
guesses "in" for its r_in highest-scored canaries and "out" for its r_out lowest, abstaining on the
rest; v of its r = r_in + r_out guesses are right. Their main theorem, in the form their appendix's
algorithm computes it (δ > 0 included): if the training run is (ε, δ)-DP, then

    P[V ≥ v] ≤ P[Binomial(r, e^ε/(1+e^ε)) ≥ v] + 2mδ · max_{1≤i≤v} P[v−i ≤ Binomial(r, ·) < v] / i,

so every ε whose p-value is below 1 − confidence is refuted, and the largest refuted ε is the
lower bound reported. Checking several guess counts is paid for by a Bonferroni correction (the
significance level is divided among them), so the bound keeps its confidence.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from dpltm.errors import DpltmUserError

#: Fractions of the m canaries guessed on each side (in and out), tried together under Bonferroni.
GUESS_FRACTIONS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[≥ v correct of r guesses] for an (ε, δ)-DP run with m canaries (Steinke et al., Alg. 2)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got v={v}, r={r}, m={m}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need ε ≥ 0 and δ in [0, 1], got {epsilon}, {delta}")
    accuracy = 1.0 / (1.0 + math.exp(-epsilon))  # of ε-DP randomized response, the best an attack can do
    beta = float(stats.binom.sf(v - 1, r, accuracy))  # P[Binomial(r, accuracy) ≥ v]
    if delta == 0 or v == 0:
        return min(1.0, beta)
    # alpha = max over i = 1..v of P[v > Binomial ≥ v − i] / i (the loop of their Algorithm 2, vectorised)
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, accuracy))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, beta + alpha * delta * 2 * m)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float) -> float:
    """The largest ε refuted at `significance` (1 − confidence) by v correct of r guesses: every
    smaller ε has p-value below it. 0 when nothing is refuted."""
    if not 0 < significance < 1:
        raise ValueError(f"significance must lie in (0, 1), got {significance}")
    if r == 0 or p_value(m, r, v, 0.0, delta) >= significance:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < significance:  # p-value grows with ε
        low, high = high, 2 * high
        if high > 1e3:
            return low
    for _ in range(40):  # bisection: the interval shrinks 2⁴⁰-fold (≤ 1e-9 for a bound below 1000)
        middle = (low + high) / 2
        if p_value(m, r, v, middle, delta) < significance:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class AuditBound:
    """The lower bound and the guesses that gave it."""

    epsilon_lower_bound: float
    canaries: int
    guesses: int
    correct: int
    confidence: float
    delta: float
    guess_counts_tried: tuple[int, ...]


def bound_from_scores(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, delta: float,
                      confidence: float = 0.95, fractions: Sequence[float] = GUESS_FRACTIONS) -> AuditBound:
    """Rank canaries by score (higher: more likely included); for each k = fraction·m guess the top
    k "in" and the bottom k "out"; the best bound over the k tried, each at significance
    (1 − confidence)/(number of k): a union bound, so the reported bound keeps its confidence.
    Ties are broken by a hash of the scores (a function of what the attack saw, never of the
    inclusion bits). When nothing is refuted, the guess count with the smallest p-value at ε = 0 is
    reported, so "0 of 0" never hides how the attack did."""
    scores = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(included, dtype=bool)
    m = int(scores.size)
    if m == 0 or truth.shape != scores.shape:
        raise DpltmUserError("an audit needs one score and one inclusion bit per canary")
    if not 0.5 <= confidence < 1:  # below 1/2 a "lower bound" is likelier wrong than right
        raise DpltmUserError(f"--confidence must lie in [0.5, 1), got {confidence}")
    finite = np.where(np.isfinite(scores), scores, -np.inf)  # a canary the attack cannot score ranks last
    digest = hashlib.sha256(np.ascontiguousarray(scores).tobytes()).digest()
    jitter = np.random.default_rng(int.from_bytes(digest[:8], "little")).random(m)
    order = np.lexsort((jitter, -finite))  # descending score
    counts = sorted({max(1, min(m // 2, int(round(f * m)))) for f in fractions})
    significance = (1 - confidence) / len(counts)
    best, best_key = None, (-1.0, 0.0)
    for k in counts:
        top, bottom = order[:k], order[m - k:]
        correct = int(truth[top].sum() + (~truth[bottom]).sum())
        bound = epsilon_lower_bound(m, 2 * k, correct, delta, significance)
        key = (bound, -p_value(m, 2 * k, correct, 0.0, delta))  # the larger bound; then the stronger evidence
        if best is None or key > best_key:
            best, best_key = AuditBound(bound, m, 2 * k, correct, confidence, delta, tuple(counts)), key
    assert best is not None
    return best
