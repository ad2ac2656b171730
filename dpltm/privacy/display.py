"""How privacy figures are shown: an upper bound is rounded UP, a lower bound DOWN.

A displayed ε that is an upper bound (what a run spent, what a σ gives, what is left) must never
read below the computed value: `:.4g` shows 0.7006 for 0.700612, which claims more privacy than the
accountant proved. δ is a bound of the same kind (the probability the ε-guarantee fails) and is
rounded up too. An empirical *lower* bound (the audit's) is rounded down for the same reason: it must
never claim more leakage was proved than was. Every ε printed by dpltm goes through these; JSON keeps
the exact floats.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal


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


def round_up(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, rounded UP: a displayed upper bound never understates."""
    return _rounded(value, digits, ROUND_CEILING)


def round_down(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, rounded DOWN: a displayed lower bound never overstates."""
    return _rounded(value, digits, ROUND_FLOOR)


def format_epsilon(value: float, digits: int = 4) -> str:
    """An ε that is an upper bound (spent, planned, claimed), for display."""
    return round_up(value, digits)


def format_delta(value: float, digits: int = 3) -> str:
    """A δ for display, rounded up (1e-05 stays 1e-05)."""
    if not math.isfinite(value) or value <= 0.0:
        return _rounded(value, digits, ROUND_CEILING)
    text = round_up(value, digits)
    return f"{float(text):.{digits}g}"
