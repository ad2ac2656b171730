"""`--neighbouring replace-one` on account and train: ε stated for the relation asked for, agreeing with
dp-accounting, and recorded in the checkpoint's ledger and statement."""

from __future__ import annotations

import json

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation

from dpltm.privacy.ledger import PrivacyLedger
from tests.datafiles import write_digits


def pld_epsilon(q: float, sigma: float, steps: int, relation: NeighboringRelation) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(relation)
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return float(accountant.get_epsilon(1e-5))


@pytest.fixture(scope="session")
def account(cli):  # type: ignore[no-untyped-def]
    def run(*flags: str) -> dict:  # type: ignore[type-arg]
        result = cli("account", "--q", "0.01", "--sigma", "1.0", "--steps", "1000", "--json", *flags)
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    return run


def test_account_states_replace_one_as_dp_accounting_does(account) -> None:
    add = {r["accountant"]: r["epsilon"] for r in account()["rows"]}
    replace = account("--neighbouring", "replace-one")
    rows = {r["accountant"]: r["epsilon"] for r in replace["rows"]}
    assert replace["neighboring"] == "replace_one" and rows["rdp"] is None and "gdp" not in rows
    truth = pld_epsilon(0.01, 1.0, 1000, NeighboringRelation.REPLACE_ONE)
    assert abs(rows["pld"] - truth) <= 1e-9 * truth and rows["pld"] > add["pld"]
    assert {r["accountant"]: r["epsilon"] for r in account("--neighboring", "add-remove")["rows"]} == add


def test_train_records_the_relation_in_the_ledger(tmp_path, monkeypatch, cli) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DPLTM_DATA_DIR", str(write_digits(tmp_path / "data")))
    out = tmp_path / "m.pt"
    cli("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "1", "--batch-size", "32",
        "--device", "cpu", "--no-progress", "--out", str(out), "--neighbouring", "replace-one")
    body = torch.load(out, weights_only=True)
    ledger = PrivacyLedger.from_json(body["privacy"]["ledger"])
    assert ledger.neighboring == "replace_one" and "replace-one adjacency" in ledger.statement()
    t = ledger.training
    assert t is not None
    truth = pld_epsilon(t["q"], t["sigma"], int(t["steps"]), NeighboringRelation.REPLACE_ONE)
    assert abs(ledger.best_bound().epsilon - truth) <= 1e-9 * truth and truth <= 1.0
