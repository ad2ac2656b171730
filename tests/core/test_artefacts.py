"""`TrainedModel`: a model checkpoint with one privacy record, everything else computed from it.

Why these tests: a second stored copy of ε or of the statement could disagree with the ledger, and
a reader would print whichever it picked; a damaged or outdated file must be refused in one line
naming the file and the field; and the ε the artefact computes must be the accountant's, not a
number of its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_accounting import (  # type: ignore[import-untyped]
    GaussianDpEvent,
    NeighboringRelation,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from dp_accounting.pld import PLDAccountant  # type: ignore[import-untyped]
from dp_accounting.rdp import RdpAccountant  # type: ignore[import-untyped]

from dpltm.artefacts import MODEL_KEYS, PRIVACY_KEYS, Outcome, PrivacyRecord, TrainedModel
from dpltm.artefacts.format import FORMAT_VERSION
from dpltm.artefacts.trained_model import EpochRow, TransferRecord
from dpltm.checkpoint import load_checkpoint, load_trained_model, save_atomic
from dpltm.errors import DpltmUserError
from dpltm.masks import apply_masks_, stored_state
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.privacy.ledger import PrivacyLedger, training_record

Q, SIGMA, STEPS, DELTA = 0.01, 1.1, 500, 1e-5
LEGACY_REPORT_KEYS = [
    "test_accuracy", "val_accuracy", "epochs_run", "steps", "stop_reason", "epsilon", "epsilon_dp_part",
    "epsilon_scope", "warning", "epsilon_spent_at_stop", "delta", "accountant", "composition", "neighboring",
    "end_to_end_dp", "private", "caveats", "statement", "privacy", "tickets", "density", "transfer",
    "released_weights", "noise_multiplier", "noise_parameter", "sigma_calibrated", "sample_rate", "dataset",
    "output", "randomness", "processes", "log_dir"]
"""The keys `train --json` printed before TrainedModel, in their order: the report must keep them."""


def _ledger(phase1: str = "public", accountant: str = "pld") -> PrivacyLedger:
    return PrivacyLedger(phase1=phase1, phase1_dataset="mnist (train split)" if phase1 != "none" else None,
                         private_dataset="digits", selection_eps1=None,
                         training=training_record(Q, SIGMA, STEPS, 1.0, Q * 1000, 1000), delta=DELTA,
                         accountant=accountant)


def _trained(privacy: PrivacyRecord | None = None) -> TrainedModel:
    network = LeNet(build_architecture(64, 10, (16,), None), torch.Generator().manual_seed(0))
    masks = {name: mask.clone() for name, mask in network.full_masks().items()}
    masks["hidden.0.weight"][:, ::2] = False  # a ticket: half of the first layer pruned
    masks = apply_masks_(network, masks)
    history = (EpochRow(epoch=1, steps=250, val_accuracy=0.5, test_accuracy=0.4, epsilon=0.7),
               EpochRow(epoch=2, steps=500, val_accuracy=0.6, test_accuracy=0.55, epsilon=1.0))
    return TrainedModel(
        architecture=network.arch.to_dict(), state_dict=stored_state(network, masks),
        privacy=privacy or PrivacyRecord(_ledger()), history=history,
        config={"data": {"split": "train", "val_fraction": 0.1}, "train": {"epochs": 2}, "model": {}, "seed": 0},
        data={"dataset": "digits", "split": "train", "n_train": 1000},
        outcome=Outcome(steps=STEPS, stop_reason="finished 2 epochs", tickets="tickets from mnist", density=0.2,
                        released_weights="final iterate", noise_parameter=SIGMA, sigma_calibrated=False,
                        output="m.pt", processes=1, randomness="os csprng"),
        transfer=TransferRecord("direct"), ticket=None, dpltm_version="test")


def _independent_epsilon(accountant: str = "pld") -> float:
    """ε of SelfComposed(PoissonSampled(q, Gaussian(σ)), T) straight from dp_accounting."""
    event = SelfComposedDpEvent(PoissonSampledDpEvent(Q, GaussianDpEvent(SIGMA)), STEPS)
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = PLDAccountant(neighboring_relation=relation) if accountant == "pld" else RdpAccountant(
        neighboring_relation=relation)
    return float(acc.compose(event).get_epsilon(DELTA))


def _same(a: TrainedModel, b: TrainedModel) -> None:
    assert set(a.state_dict) == set(b.state_dict)
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    for name in ("architecture", "history", "config", "data", "outcome", "transfer", "ticket", "dpltm_version"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.privacy.to_dict() == b.privacy.to_dict()
    assert a.report() == b.report()


def test_round_trip_in_memory_and_through_a_file(tmp_path: Path) -> None:
    """to_dict/from_dict lose nothing; so does a file written by save_atomic and read back."""
    trained = _trained(PrivacyRecord(_ledger(), ("the tickets' data was asserted public",), False))
    _same(trained, TrainedModel.from_dict(trained.to_dict(), "memory"))
    path = tmp_path / "m.pt"
    save_atomic(trained.to_dict(), path, "model")
    loaded = load_trained_model(path)
    _same(trained, loaded)
    assert loaded.environment and loaded.environment["dpltm"]  # provenance added by the write
    assert loaded.network()(torch.zeros(2, 64)).shape == (2, 10)
    # the network and its masks come back apart: a plain module with the stored weights, and the ticket
    network, masks = loaded.network(), loaded.masks
    assert not any(k.startswith("mask") for k in network.state_dict())
    for key, value in network.state_dict().items():
        assert torch.equal(value, trained.state_dict[key]), key
    assert masks.keys() == set(network.mask_names())
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and torch.equal(mask, trained.state_dict["mask_" + name.replace(".", "_")])
        assert torch.count_nonzero(network.weights()[name][~mask]) == 0, name
    assert not bool(masks["hidden.0.weight"].all()) and bool(masks["output.weight"].all())


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, (list, tuple)):
        return {k for v in value for k in _keys(v)}
    return set()


def test_the_file_holds_the_privacy_record_once(tmp_path: Path) -> None:
    """Stored: the ledger and the caveats; ε, its scope, the statement and the ledger's report are not."""
    path = tmp_path / "m.pt"
    save_atomic(_trained().to_dict(), path, "model")
    body = torch.load(path, weights_only=True)
    assert set(body) == {"format", "kind", "format_version", "environment", *MODEL_KEYS}
    assert body["format_version"] == FORMAT_VERSION == 4
    assert set(body["privacy"]) == set(PRIVACY_KEYS) == {"ledger", "caveats", "adaptive_stop"}
    computed = {"epsilon", "epsilon_dp_part", "epsilon_scope", "overall_epsilon", "statement", "warning",
                "composition", "end_to_end_dp", "bounds", "report"}
    stored = {k: v for k, v in body.items() if k not in ("privacy", "history", "state_dict")}
    assert not computed & _keys(stored)
    assert not computed & _keys(body["privacy"]["ledger"])  # the ledger stores inputs, not results


def test_report_keeps_the_keys_train_json_printed() -> None:
    """`train --json` prints the same keys, in the same order, as before the artefact existed."""
    report = _trained().report().to_json()
    assert list(report) == LEGACY_REPORT_KEYS
    assert report["noise_multiplier"] == SIGMA and report["sample_rate"] == Q and report["epochs_run"] == 2
    assert report["test_accuracy"] == 0.55 and report["epsilon_spent_at_stop"] == 1.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_computed_epsilon_is_the_accountants(accountant: str) -> None:
    """Public tickets, training only: ε is dp_accounting's for the DP-SGD event, to the last digit."""
    record = PrivacyRecord(_ledger(accountant=accountant))
    expected = _independent_epsilon(accountant)
    assert record.epsilon == pytest.approx(expected, rel=1e-12) and record.end_to_end_dp
    assert record.epsilon_dp_part == record.epsilon
    report = _trained(record).report()
    assert report.epsilon == record.ledger.report()["epsilon"] and report.delta == DELTA
    assert report.statement == record.ledger.statement()


def test_same_data_and_adaptive_stop_give_no_overall_epsilon() -> None:
    """Same-data tickets: the whole run's ε is ∞, the DP part's is the accountant's. An adaptive stop
    keeps the planned run's ε for the DP part, calls the run not DP end to end, and says why first."""
    same = PrivacyRecord(_ledger("same-data"))
    assert same.epsilon == math.inf and _trained(same).report().epsilon == "inf" and not same.end_to_end_dp
    assert same.epsilon_dp_part == pytest.approx(_independent_epsilon(), rel=1e-12)
    stopped = PrivacyRecord(_ledger(), ("early stopping looked at validation records",), True)
    assert not stopped.end_to_end_dp and stopped.epsilon == math.inf
    assert stopped.statement.startswith("CAVEAT: early stopping") and stopped.statement.endswith(
        stopped.ledger.statement())
    assert _trained(stopped).report().epsilon_spent_at_stop is None


def _refused(path: Path) -> str:
    with pytest.raises(DpltmUserError) as caught:
        load_checkpoint(path, "model")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(path) in message
    return message


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda b: b["privacy"].__setitem__("epsilon", 0.1), "computed from its ledger, not stored"),
    (lambda b: b.__setitem__("report", {"statement": "DP"}), "holds unknown ['report']"),
    (lambda b: b["privacy"].pop("ledger"), "lacks 'privacy.ledger'"),
    (lambda b: b["privacy"]["ledger"].__setitem__("delta", "tiny"), "'privacy.ledger' is invalid"),
    (lambda b: b["privacy"].__setitem__("adaptive_stop", "no"), "'privacy.adaptive_stop' has the wrong type"),
    (lambda b: b["privacy"].__setitem__("caveats", [1]), "'privacy.caveats' must be a list of strings"),
    (lambda b: b["outcome"].__setitem__("steps", "many"), "'outcome.steps' has the wrong type"),
    (lambda b: b.pop("history"), "lacks 'history'"),
    (lambda b: b["state_dict"].__setitem__("output.bias", torch.zeros(3)), "has shape (3,)"),
    (lambda b: b["state_dict"].pop("mask_output_weight"), "missing ['mask_output_weight']"),
    (lambda b: b["state_dict"].__setitem__("mask_output_weight", torch.ones(10, 16)), "has dtype torch.float32"),
    (lambda b: b.__setitem__("architecture", {}), "'architecture' is invalid"),
    (lambda b: b["state_dict"]["hidden.0.weight"].fill_(1.0), "'state_dict.hidden.0.weight' is non-zero where"),
])
def test_a_damaged_file_is_refused_in_one_line(tmp_path: Path, edit: Any, fragment: str) -> None:
    path = tmp_path / "m.pt"
    body = _trained().to_dict()
    edit(body)
    torch.save(body, path)
    message = _refused(path)
    assert "is a damaged 'model' checkpoint" in message and fragment in message, message


def test_a_format_2_model_is_refused_and_other_format_2_kinds_still_read(tmp_path: Path) -> None:
    """Format 2 model files kept a second copy of the privacy facts: refused in one line. Ticket sets,
    winners and library runs did not change layout in format 3, so theirs still pass the version check."""
    path = tmp_path / "old.pt"
    legacy = {**_trained().to_dict(), "format_version": 2}
    legacy.pop("privacy")
    torch.save({**legacy, "ledger": _ledger().to_json(), "report": {"statement": "DP"}}, path)
    assert "model of checkpoint format 2" in _refused(path) and "train it again" in _refused(path)
    torch.save({"format": "dpltm", "kind": "ticket", "format_version": 2}, path)
    with pytest.raises(DpltmUserError, match="damaged 'ticket' checkpoint: it lacks 'architecture'"):
        load_checkpoint(path, "ticket")
    torch.save({"format": "dpltm", "kind": "ticket", "format_version": 1}, path)
    with pytest.raises(DpltmUserError, match=r"has checkpoint format 1, this dpltm reads format 4$"):
        load_checkpoint(path, "ticket")
