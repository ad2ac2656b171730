"""Phase 2 of DPLTM: choose the winning ticket with the exponential mechanism.

The paper (Alg. 1, phase 2, eq. 2) scores ticket i by S_i = A_i·(1 − ν·C_i), where A_i is
its accuracy and C_i the fraction of weights it keeps, and picks i with probability

    P(i) ∝ exp(ε1·S_i / (2Δ)),

the exponential mechanism of McSherry & Talwar (2007, Thm 6), which is ε1-DP whenever Δ
bounds how much any single score can move between neighbouring datasets.

Sensitivity (docs/privacy.md §2). C_i is fixed by the pruning schedule, not by data, while
A_i ∈ [0, 1] may change arbitrarily between neighbours (it comes from non-private
training), so |S_i − S_i'| = |A_i − A_i'|·|1 − ν·C_i| ≤ ΔA·|1 − ν·C_i| and

    Δ = ΔA · max_i |1 − ν·C_i|.

With ΔA = 1 and the dense ticket (C = 1) among the candidates this is the paper's
Lemma 1, Δ = |1 − ν| for ν > 1. Where the accuracies are measured on n records that did not
shape the tickets (public tickets scored on a private holdout), ΔA = 1/n.

At the paper's settings (ν = 50, so Δ = 49) the selection is close to uniform for any
sensible ε1: `near_uniform` and `decisive_eps1` let the CLI say so.

Randomness. A seeded `numpy.random.Generator` is reproducible, which is what tests and
replications want but is not a secret; with no seed, `make_selection_rng(None)` returns a
`random.SystemRandom` (the OS CSPRNG), so the draw cannot be predicted from a seed.
Both are used the same way: one uniform in [0, 1), inverted through the cumulative
distribution. The probabilities are IEEE doubles, which leaks at most what floating-point
rounding leaks (Ilvento 2020 gives an exact base-2 variant); we accept this, as
dp-accounting and Opacus do for their Gaussian noise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from dpltm.errors import DpltmUserError

FloatArray = npt.NDArray[np.float64]
ArrayLike1D = Sequence[float] | npt.NDArray[np.floating] | npt.NDArray[np.integer]
SelectionRng = np.random.Generator | random.SystemRandom

#: `near_uniform`'s default: every ticket within ±10 % of 1/k.
NEAR_UNIFORM_TOLERANCE = 0.1

#: The largest selection budget ε1 accepted. ε1 = 100 is already no privacy at all (e^100), and
#: bounding it keeps ε1²/8 (the zCDP ρ of the selection) and ε1·S/(2Δ) far from overflow.
MAX_EPS1 = 100.0


# ---- validation ---------------------------------------------------------------------------


def _vector(values: ArrayLike1D, name: str) -> FloatArray:
    """`values` as a finite, non-empty 1-D float64 array, or a DpltmUserError."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DpltmUserError(f"{name} must be a list of numbers ({exc})") from None
    if arr.ndim != 1:
        raise DpltmUserError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise DpltmUserError(f"{name} must not be empty")
    if not np.all(np.isfinite(arr)):
        raise DpltmUserError(f"{name} must be finite, got {arr.tolist()}")
    return arr


def _check_positive(value: float, name: str) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise DpltmUserError(f"{name} must be a positive finite number, got {value}")
    return v


def check_eps1(eps1: float, name: str = "eps1") -> float:
    """The selection budget ε1 as a float in (0, MAX_EPS1], or a DpltmUserError naming `name`."""
    try:
        e = float(eps1)
    except (TypeError, ValueError):
        raise DpltmUserError(f"{name} must be a number, got {eps1!r}") from None
    if not (math.isfinite(e) and 0.0 < e <= MAX_EPS1):
        raise DpltmUserError(f"{name} must lie in (0, {MAX_EPS1:g}], got {eps1}")
    return e


def _check_nu(nu: float) -> float:
    v = float(nu)
    if not (math.isfinite(v) and v >= 0.0):
        raise DpltmUserError(f"nu must be a finite number >= 0, got {nu}")
    return v


def _densities(densities: ArrayLike1D) -> FloatArray:
    c = _vector(densities, "densities")
    if np.any(c <= 0.0) or np.any(c > 1.0):
        raise DpltmUserError(
            f"densities (fraction of weights kept) must lie in (0, 1], got {c.tolist()}"
        )
    return c


# ---- scores and sensitivity ---------------------------------------------------------------


def ticket_scores(accuracies: ArrayLike1D, densities: ArrayLike1D, nu: float) -> FloatArray:
    """The paper's score S_i = A_i·(1 − ν·C_i) (DPLTM eq. 1, Alg. 1 line 21).

    High accuracy raises the score and, for ν > 0, so does a sparser ticket: ν trades the
    two off. `accuracies` lie in [0, 1], `densities` (fraction of weights kept) in (0, 1].
    """
    a = _vector(accuracies, "accuracies")
    c = _densities(densities)
    if a.shape != c.shape:
        raise DpltmUserError(
            f"accuracies and densities must have equal lengths, got {a.size} and {c.size}"
        )
    if np.any(a < 0.0) or np.any(a > 1.0):
        raise DpltmUserError(f"accuracies must lie in [0, 1], got {a.tolist()}")
    return a * (1.0 - _check_nu(nu) * c)


def score_sensitivity(
    densities: ArrayLike1D, nu: float, accuracy_sensitivity: float = 1.0
) -> float:
    """Δ = ΔA · max_i |1 − ν·C_i|: how far one record can move any ticket's score.

    Why (docs/privacy.md §2): C_i is set by the pruning schedule, independent of the data, so
    only A_i moves, by at most ΔA, and S_i moves by at most ΔA·|1 − ν·C_i|. The maximum over
    the candidates is the sensitivity the exponential mechanism needs (McSherry & Talwar
    2007). With ΔA = 1 (accuracy from non-private training on the private data can change
    arbitrarily) and the dense ticket C = 1 among the candidates, this is the paper's
    Lemma 1, Δ = |1 − ν| for ν > 1.

    `accuracy_sensitivity` is ΔA ∈ (0, 1]. Use 1/n when the accuracies are measured on n
    held-out records that did not shape the tickets: |c/n − c'/(n ± 1)| ≤ 1/n for the
    holdout of size n, so 1/n covers both replace-one and add/remove-one neighbours.
    """
    c = _densities(densities)
    da = _check_positive(accuracy_sensitivity, "accuracy_sensitivity")
    if da > 1.0:
        raise DpltmUserError(
            f"accuracy_sensitivity must be at most 1 (accuracies lie in [0, 1]), got {da}"
        )
    return float(da * np.max(np.abs(1.0 - _check_nu(nu) * c)))


# ---- the mechanism ------------------------------------------------------------------------


def selection_log_probabilities(
    scores: ArrayLike1D, eps1: float, sensitivity: float
) -> FloatArray:
    """log P(i) = ε1·S_i/(2Δ) − logsumexp_j(ε1·S_j/(2Δ)) (DPLTM eq. 2; McSherry & Talwar 2007).

    Computed as a log-softmax with the maximum subtracted first, so large ε1/Δ neither
    overflows nor rounds every other ticket to probability 0 in log space.
    """
    s = _vector(scores, "scores")
    e = _check_positive(eps1, "eps1")
    d = _check_positive(sensitivity, "sensitivity")
    logits = (e / (2.0 * d)) * s
    if not np.all(np.isfinite(logits)):
        raise DpltmUserError(f"eps1·score/(2·sensitivity) overflows for eps1={e:g}, Δ={d:g}")
    shifted = logits - np.max(logits)
    log_norm = math.log(float(np.sum(np.exp(shifted))))
    out: FloatArray = (shifted - log_norm).astype(np.float64)
    return out


def selection_probabilities(scores: ArrayLike1D, eps1: float, sensitivity: float) -> FloatArray:
    """P(i) of the exponential mechanism; see `selection_log_probabilities`."""
    out: FloatArray = np.exp(selection_log_probabilities(scores, eps1, sensitivity))
    return out


def make_selection_rng(seed: int | None) -> SelectionRng:
    """The source of randomness for the selection draw.

    With a seed: `numpy.random.default_rng(seed)`, reproducible (tests, replications), but
    anyone who knows the seed knows the draw, so the DP guarantee then assumes the seed is
    secret. Without a seed: `random.SystemRandom()`, the operating system's
    cryptographically secure generator (`os.urandom`), which is what the privacy proof
    assumes of the mechanism's coins.
    """
    if seed is None:
        return random.SystemRandom()
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise DpltmUserError(f"selection seed must be an integer or None, got {seed!r}")
    return np.random.default_rng(int(seed))


def _uniform(rng: SelectionRng) -> float:
    """One uniform draw in [0, 1) with 53 random bits, from either kind of source."""
    if isinstance(rng, np.random.Generator | random.Random):  # SystemRandom is a subclass of Random
        return float(rng.random())
    raise DpltmUserError(
        f"rng must be a numpy.random.Generator or random.SystemRandom, got {type(rng).__name__}"
    )


def sample_exponential(
    scores: ArrayLike1D,
    eps1: float,
    sensitivity: float,
    rng: SelectionRng | None = None,
) -> int:
    """Draw a ticket index with the exponential mechanism (ε1-DP; McSherry & Talwar 2007).

    Inverse-CDF sampling on the stable log-probabilities: the probabilities are obtained
    from the max-shifted log-softmax, so no term overflows, and one uniform u ∈ [0, 1) is
    compared with their running sum (scaled by its total, so rounding in the sum cannot
    push u past the last ticket). `rng=None` draws from the OS CSPRNG
    (`make_selection_rng(None)`).
    """
    logp = selection_log_probabilities(scores, check_eps1(eps1), sensitivity)
    source = make_selection_rng(None) if rng is None else rng
    cdf = np.cumsum(np.exp(logp))
    u = _uniform(source) * float(cdf[-1])
    index = int(np.searchsorted(cdf, u, side="right"))
    # u < cdf[-1] always, so index < len(cdf); the guard only protects against rounding.
    index = min(index, cdf.size - 1)
    # Never return a ticket of probability 0 (possible only through rounding at the top).
    while logp[index] == -math.inf and index > 0:
        index -= 1
    return index


# ---- telling users what the selection does ------------------------------------------------


def near_uniform(
    probabilities: ArrayLike1D, tolerance: float = NEAR_UNIFORM_TOLERANCE
) -> bool:
    """True when every ticket's probability is within ±`tolerance`·(1/k) of uniform.

    I.e. max_i |k·P(i) − 1| ≤ tolerance. At the paper's settings (ν = 50, ε1 = 0.1,
    docs/privacy.md §2) the selection is this close to a coin toss: the CLI should say so rather
    than present the winner as chosen on merit.
    """
    p = _vector(probabilities, "probabilities")
    tol = float(tolerance)
    if not (math.isfinite(tol) and tol >= 0.0):
        raise DpltmUserError(f"tolerance must be a finite number >= 0, got {tolerance}")
    return bool(np.max(np.abs(p.size * p - 1.0)) <= tol)


def decisive_eps1(
    scores: ArrayLike1D, sensitivity: float, target_probability: float = 0.9
) -> float:
    """The smallest ε1 at which the best-scoring ticket is picked with ≥ `target_probability`.

    The best ticket's probability 1/(m + Σ_{j: S_j < S*} exp(−ε1·(S* − S_j)/(2Δ))), with m
    tickets tied at the top score S*, is non-decreasing in ε1, so bisection finds the
    threshold; the returned value is the upper end of the final bracket, so it does reach
    the target. Returns 0.0 when any ε1 > 0 already reaches it (one candidate, or a target
    ≤ 1/k) and `math.inf` when ties make it unreachable (target > 1/m). Feeds the CLI's
    "selection is close to uniform at this ε1; ε1 ≈ X would make it decisive".
    """
    s = _vector(scores, "scores")
    d = _check_positive(sensitivity, "sensitivity")
    t = float(target_probability)
    if not (0.0 < t < 1.0):
        raise DpltmUserError(f"target_probability must lie in (0, 1), got {target_probability}")
    best = int(np.argmax(s))
    ties = int(np.sum(s == s[best]))
    if t > 1.0 / ties:
        return math.inf
    if t <= 1.0 / s.size:
        return 0.0

    def p_best(eps: float) -> float:
        return float(np.exp(selection_log_probabilities(s, eps, d)[best]))

    hi = 1.0
    while p_best(hi) < t:
        hi *= 2.0
        if hi > 1e300:
            return math.inf
    lo = hi / 2.0
    while p_best(lo) >= t and lo > 1e-300:
        hi, lo = lo, lo / 2.0
    # Invariant: p_best(lo) < t <= p_best(hi).
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        if p_best(mid) >= t:
            hi = mid
        else:
            lo = mid
    return hi
