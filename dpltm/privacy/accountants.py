"""The accountants dpltm states ε with, and what each can do: the one list every front end reads.

Adding an accountant: one module with `make(relation: dp_accounting.NeighboringRelation) ->
dp_accounting.PrivacyAccountant` (like dpltm/privacy/rdp_accountant.py) and one `AccountantEntry` line
below. The CLI's `--accountant` choices, the API's, the config's and the checkpoints' checks, the labels
in privacy statements and `dpltm account`'s table are derived from this table; the shared suite in
tests/privacy/test_accountants.py runs every entry against dp-accounting. Only *sound* accountants (an
upper bound on the true ε) belong here: an approximation such as the GDP central limit theorem is
offered apart and labelled (dpltm.privacy.accounting.gdp_epsilon). This module imports nothing heavy,
so `dpltm --help` stays quick; an accountant's module is imported when it is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from dpltm.errors import DpltmUserError


@dataclass(frozen=True)
class AccountantEntry:
    name: str
    label: str
    """How statements and tables name it ("PLD accountant")."""
    module: str
    """The module with `make(relation)`, and optionally `dpsgd_epsilon(q, σ, T, δ, relation)`: the same ε as
    the accountant's for DP-SGD's event, computed faster (tests check the equality)."""
    cost_grows_with_epsilon: bool = False
    """Its cost grows with the privacy loss's range: run only where the cheap RDP bound says ε is modest
    (dpltm.privacy.accounting.PLD_MAX_RDP_EPSILON)."""
    min_delta: float = 0.0
    """The smallest δ it states a finite ε at. dp-accounting's PLD truncates each loss distribution's tail at
    about 1e-15 of mass, counted pessimistically as ε = ∞, so below 1e-14 its ε is ∞ whatever ran."""

    def check_delta(self, delta: float, option: str = "--delta") -> None:
        """Refuse a δ the accountant cannot state a finite ε at, in one line naming one that can."""
        if delta < self.min_delta:
            able = [e.name for e in ACCOUNTANTS.values() if delta >= e.min_delta]
            raise DpltmUserError(f"{option} {delta:g} is below the smallest δ the {self.label} accountant states a "
                                 f"finite ε at ({self.min_delta:g})"
                                 + (f": use the {able[0]} accountant, or a larger δ" if able else ""))

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


ACCOUNTANTS: dict[str, AccountantEntry] = {entry.name: entry for entry in (
    AccountantEntry("pld", "PLD", "dpltm.privacy.pld_accountant", cost_grows_with_epsilon=True, min_delta=1e-14),
    AccountantEntry("rdp", "RDP", "dpltm.privacy.rdp_accountant"),
)}
"""By name."""

OTHER_LIBRARIES_ACCOUNTANTS = {
    "prv": "Opacus's PRV accountant numerically composes the privacy loss distribution, as dp-accounting's PLD "
           "accountant does: use 'pld'",
    "gdp": "the GDP accountant's central limit theorem is an approximation, not an upper bound on ε: use 'pld' or "
           "'rdp' (`dpltm account` shows the GDP figure beside them, labelled as an approximation)",
}
"""Accountant names of other libraries (Opacus), each answered with the dpltm one to use."""


def accountant_entry(name: object, option: str = "accountant") -> AccountantEntry:
    """The entry named `name`, or one line naming `option` and the accountants there are."""
    entry = ACCOUNTANTS.get(name) if isinstance(name, str) else None
    if entry is None and isinstance(name, str) and name.lower() in OTHER_LIBRARIES_ACCOUNTANTS:
        raise DpltmUserError(f"{option} {name!r}: {OTHER_LIBRARIES_ACCOUNTANTS[name.lower()]}")
    if entry is None:
        shown = repr(name) if isinstance(name, str) else type(name).__name__
        raise DpltmUserError(f"{option} must be one of {', '.join(ACCOUNTANTS)}, got {shown}")
    return entry
