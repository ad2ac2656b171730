"""How privacy figures are shown: an upper bound is rounded UP, a lower bound DOWN.

A displayed ε (or ε1) that is an upper bound (what a run spent, what a σ gives, what is left) must never
read below the computed value: `:.4g` shows 0.7006 for 0.700612, which claims more privacy than the
accountant proved. δ is a bound of the same kind (the probability the ε-guarantee fails) and is
rounded up too, and so is a sampling rate q, while a noise multiplier σ is rounded down: ε re-derived
from the shown q and σ never falls below the one shown. An empirical *lower* bound (the audit's) is
rounded down for the same reason: it must never claim more leakage was proved than was. Every ε, σ and q
printed by dpltm goes through these; JSON keeps the exact floats.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext


def _rounded(value: float, digits: int, rounding: str) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if value <= 0.0:
        return "0"
    exponent = math.floor(math.log10(value)) - digits + 1
    exact = Decimal(repr(float(value)))  # repr: the shortest decimal that round-trips
    rounded = exact.quantize(Decimal(1).scaleb(exponent), rounding=rounding)
    return format(rounded.normalize(), "f")


def for_progress_bar(value: float) -> float:
    """An upper bound for Lightning's progress bars, which round to nearest: TQDM's to 3 significant digits, Rich's
    to 3 decimals. Rounded UP to 3 decimals (from its exact binary value), then to 3 significant digits, it reads
    no lower than `value` in either."""
    if not math.isfinite(value) or value <= 0.0:
        return value
    with localcontext(prec=400):  # enough digits for any float's integer part, whatever the caller's context
        decimals = float(Decimal(value).quantize(Decimal("0.001"), rounding=ROUND_CEILING))
    return float(round_up(decimals, 3))


def round_up(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, rounded UP: a displayed upper bound never understates."""
    return _rounded(value, digits, ROUND_CEILING)


def round_down(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, rounded DOWN: a displayed lower bound never overstates."""
    return _rounded(value, digits, ROUND_FLOOR)


def format_epsilon(value: float, digits: int = 4) -> str:
    """An ε that is an upper bound (spent, planned, claimed), for display."""
    return round_up(value, digits)


def format_sigma(value: float, digits: int = 5) -> str:
    """A noise multiplier σ for display, rounded DOWN: the ε re-derived from the shown σ never falls below
    the one stated (more noise than shown would claim less privacy than was bought)."""
    return round_down(value, digits)


def format_rate(value: float, digits: int = 4) -> str:
    """A sampling rate q for display, rounded UP: a larger q is the weaker guarantee, so the shown q never
    claims more privacy than the one that ran."""
    return round_up(value, digits)


def format_delta(value: float, digits: int = 3) -> str:
    """A δ for display, rounded up (1e-05 stays 1e-05)."""
    if not math.isfinite(value) or value <= 0.0:
        return _rounded(value, digits, ROUND_CEILING)
    text = round_up(value, digits)
    return f"{float(text):.{digits}g}"
