"""Displayed privacy figures never understate an upper bound nor overstate a lower bound."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from dpltm.privacy.display import format_delta, format_epsilon, format_rate, format_sigma, round_down, round_up
from dpltm.privacy.ledger import PrivacyLedger, training_record

positive = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False)


def test_the_issues_example_rounds_up() -> None:
    assert round_up(0.700612) == "0.701" and format_epsilon(0.700612) == "0.7007"
    assert round_down(0.700612) == "0.7"
    assert format_epsilon(1.0) == "1" and format_epsilon(math.inf) == "∞"
    assert format_delta(1e-5) == "1e-05" and float(format_delta(1.00001e-5)) >= 1.00001e-5


@given(positive, st.integers(min_value=1, max_value=8))
def test_upper_bounds_round_up_and_lower_bounds_down(value: float, digits: int) -> None:
    up, down = float(round_up(value, digits)), float(round_down(value, digits))
    assert down <= value <= up
    assert up <= value * (1 + 10 ** (1 - digits)) + 1e-300


@given(positive)
def test_format_delta_never_understates(value: float) -> None:
    assert float(format_delta(value)) >= value


def test_the_statement_shows_epsilon_rounded_up() -> None:
    ledger = PrivacyLedger(phase1="none", phase1_dataset=None, private_dataset="x", selection_eps1=None,
                           training=training_record(0.01, 1.0, 1000), delta=1e-5)
    eps = ledger.best_bound().epsilon
    shown = ledger.statement().split("(ε = ")[1].split(",")[0]
    assert float(shown) >= eps and float(shown) - eps < 1e-3 * eps


def test_no_privacy_figure_is_formatted_by_hand() -> None:
    """A guard against regressions: no `{eps…:.4g}`-style formatting of ε, ε1, δ, σ, q or a spent amount in the
    package or the benchmarks (they go through dpltm.privacy.display, which rounds each the safe way); `:g` only
    echoes a value the user typed, never a computed figure (read from a report or a plan). A suggested ε1 for the
    selection is not a bound."""
    import re
    from pathlib import Path

    import dpltm

    names = r"(eps|epsilon|delta|spent|floor|bound|sigma|noise_multiplier|noise_parameter|sample_rate|\['q'\]|rho)"
    precise = re.compile(r"\{[^}]*" + names + r"[^}]*:\.[0-9]+[gfe]\}")
    computed = re.compile(r"\{[^}]*(\[['\"][a-z_0-9]+['\"]\]|noise_multiplier|sample_rate|eps1_total|epsilon_total|"
                          r"selection_eps1)[^}]*:g\}")
    allowed = ("decisive_eps1",)
    root = Path(dpltm.__file__).parent
    found = [f"{path.name}:{n}" for folder in (root, root.parent / "benchmarks") for path in folder.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if (precise.search(line) or (computed.search(line) and names_privacy(line)))
             and not any(a in line for a in allowed)]
    assert not found, found


def names_privacy(line: str) -> bool:
    import re

    return re.search(r"\{[^}]*(eps|epsilon|delta|sigma|noise|sample_rate|\['q'\]|rho)[^}]*:g\}", line) is not None


def test_sigma_rounds_down_and_q_up() -> None:
    """σ shown rounded down, q up: ε re-derived from the shown figures never falls below the stated one (the
    README job's σ = 6.80117 once showed as 6.8012)."""
    assert format_sigma(6.80117) == "6.8011" and format_rate(400 / 54000) == "0.007408"


@given(positive)
def test_shown_sigma_and_q_are_the_safe_side(value: float) -> None:
    assert float(format_sigma(value)) <= value <= float(format_rate(value))
