"""Every registered accountant (dpltm.privacy.accountants) against dp-accounting: the ε dpltm states is the
accountant's own, and it is an upper bound (never below a finer PLD of the same mechanism)."""

from __future__ import annotations

import math
import sys
import types

import dp_accounting as dpa
import pytest

from dpltm.choices import Accountant
from dpltm.errors import DpltmUserError
from dpltm.privacy import accounting
from dpltm.privacy.accountants import ACCOUNTANTS, AccountantEntry
from dpltm.privacy.accounting import check_accountant as api_check_accountant
from dpltm.privacy.events import dpsgd_event
from dpltm.settings import TrainSettings

RELATIONS = {"add_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
             "replace_one": dpa.NeighboringRelation.REPLACE_ONE}
SETTINGS = [(400 / 60000, 2.49, 7500, 1e-5), (0.02, 1.1, 300, 1e-5), (0.1, 5.0, 50, 1e-6)]


def _reference(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's PLD at a ten times finer grid: as close to the true ε as we can compute."""
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-5)
    acc.compose(dpsgd_event(q, sigma, steps))
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("name", list(ACCOUNTANTS))
@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), SETTINGS)
def test_every_accountant_states_its_own_epsilon_and_an_upper_bound(name: str, q: float, sigma: float, steps: int,
                                                                     delta: float) -> None:
    entry = ACCOUNTANTS[name]
    own = entry.load().make(RELATIONS["add_remove"])
    event = dpsgd_event(q, sigma, steps)
    assert own.supports(event)
    own.compose(event)
    accounting._epsilon_cached.cache_clear()
    stated = accounting.epsilon(event, delta, name)
    assert stated == pytest.approx(float(own.get_epsilon(delta)), rel=1e-12)  # its fast path, if any, included
    reference = _reference(q, sigma, steps, delta)
    assert reference * (1 - 1e-3) <= stated <= reference * 1.25
    assert f"{entry.label} accountant" in accounting.composition_bounds(None, event, delta, name)[0].description


def test_the_cli_the_config_and_the_api_offer_exactly_the_registry() -> None:
    assert [member.value for member in Accountant] == list(ACCOUNTANTS)
    for name in ACCOUNTANTS:
        assert api_check_accountant(name) == name and TrainSettings(accountant=name).accountant == name
    with pytest.raises(DpltmUserError, match=r"^accountant must be one of pld, rdp, got 'moments'$"):
        api_check_accountant("moments")
    with pytest.raises(DpltmUserError, match=r"^--accountant must be one of pld, rdp, got 'zcdp'$"):
        TrainSettings(accountant="zcdp")


@pytest.mark.parametrize(("name", "instead"), [
    ("prv", "use 'pld'$"), ("PRV", "use 'pld'$"), ("gdp", "an approximation, not an upper bound")])
def test_an_opacus_accountant_name_says_which_one_to_use(name: str, instead: str) -> None:
    in_settings = lambda a: TrainSettings(accountant=a)  # noqa: E731
    for check, option in ((api_check_accountant, "accountant"), (in_settings, "--accountant")):
        with pytest.raises(DpltmUserError, match=rf"^{option} '{name}': .*{instead}"):
            check(name)
    with pytest.raises(DpltmUserError, match=r"^accountant must be one of pld, rdp, got list$"):
        api_check_accountant(["pld"])


def test_adding_an_accountant_is_one_module_and_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with `make(relation)` and a line in the table: every ε path takes it."""
    module = types.ModuleType("tests_fake_accountant")
    module.make = lambda relation: dpa.rdp.RdpAccountant(neighboring_relation=relation)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(ACCOUNTANTS, "rdp2", AccountantEntry("rdp2", "RDP (again)", module.__name__))
    accounting._epsilon_cached.cache_clear()
    event = dpsgd_event(0.02, 1.1, 300)
    assert accounting.epsilon(event, 1e-5, "rdp2") == accounting.epsilon(event, 1e-5, "rdp")
    assert api_check_accountant("rdp2") == "rdp2"


def test_a_delta_below_what_the_pld_accountant_resolves_is_refused_in_one_line() -> None:
    """dp-accounting's PLD counts its truncated tail (about 1e-15 of mass) as ε = ∞: below `min_delta` every run
    would be stated at ε = ∞ (and calibration would say no σ suffices), so the δ is refused, naming RDP."""
    from dpltm.errors import DpltmUserError
    from dpltm.privacy.accountants import ACCOUNTANTS
    from dpltm.privacy.accounting import epsilon
    from dpltm.privacy.events import dpsgd_event
    from dpltm.settings import TrainSettings

    pld = ACCOUNTANTS["pld"]
    event = dpsgd_event(0.05, 1.3, 21)
    assert math.isfinite(epsilon(event, pld.min_delta, "pld", "add_remove"))
    assert epsilon(event, 1e-16, "pld", "add_remove") == math.inf
    assert math.isfinite(epsilon(event, 1e-16, "rdp", "add_remove"))
    with pytest.raises(DpltmUserError, match="below the smallest δ the PLD accountant"):
        TrainSettings(delta=1e-16)
    assert TrainSettings(delta=1e-16, accountant="rdp").delta == 1e-16
