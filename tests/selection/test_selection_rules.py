"""The selection-rule registry (dpltm.selection.rules): one shared suite over every entry, the
exponential rule's draws against its stated probabilities, and a rule added by this file alone used
end to end by `stage_select` (the claim that a new rule touches the registry and its own function only).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dp_accounting import NonPrivateDpEvent, NoOpDpEvent, ZCDpEvent  # type: ignore[import-untyped]
from scipy.stats import chisquare

from dpltm.artefacts import TicketSet, Winner
from dpltm.checkpoint import load_checkpoint
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.privacy.events import event_from_json
from dpltm.privacy.exponential import selection_probabilities
from dpltm.privacy.ledger import PrivacyLedger
from dpltm.selection.rules import SELECTION_RULES, RuleSettings, SelectionRule, selection_rule
from dpltm.selection.winner import Selection, make_winner, select_best
from dpltm.stages.select import stage_select
from dpltm.training.pipeline import ticket_origin
from tests.core import bodies
from tests.datafiles import write_digits

ACCURACIES = [0.9, 0.8, 0.6, 0.3]
DENSITIES = [1.0, 0.5, 0.25, 0.125]
NU, EPS1 = 0.5, 10.0  # Δ = 0.9375: P ≈ (0.20, 0.44, 0.29, 0.08), neither uniform nor argmax


def _kept(keep: float) -> dict[str, torch.Tensor]:
    """Masks keeping exactly the first `keep` of each layer's weights (so C is exactly `keep`)."""
    masks = {}
    for name, mask in bodies.ticket(0, 1.01, 0.0).masks.items():
        flat = torch.zeros(mask.numel(), dtype=torch.bool)
        flat[:round(mask.numel() * keep)] = True
        masks[name] = flat.reshape(mask.shape)
    return masks


def ticket_set(dataset: str = "blobs") -> TicketSet:
    """A ticket set whose rounds have the accuracies A and densities C above."""
    records = tuple(dataclasses.replace(bodies.ticket(r, 1.01, a), masks=_kept(c), density=c, trained=None,
                                        layer_density={n: c for n in _kept(c)})
                    for r, (a, c) in enumerate(zip(ACCURACIES, DENSITIES)))
    return bodies.ticket_set(tickets=records, data={**bodies.DATA, "dataset": dataset, "split": "train"})


def stub_planned_run(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """Stands in for the noise-aware training (tests/test_noise_aware.py runs the real one)."""
    return select_best(tickets, settings)


def settings_for(rule: SelectionRule, seed: int | None = 0) -> RuleSettings:
    return RuleSettings(nu=NU, seed=seed, eps1=EPS1 if rule.spends_eps1 else None,
                        planned_run=object() if rule.needs_planned_run else None)


def runnable(rule: SelectionRule) -> SelectionRule:
    """The rule, its planned-run training replaced by a stub (the event comes from the same `select`)."""
    return dataclasses.replace(rule, target=f"{__name__}:stub_planned_run") if rule.needs_planned_run else rule


def ledger_of(winner: Winner, private_name: str) -> PrivacyLedger:
    """The ledger `dpltm train` builds for `winner` on the private dataset `private_name`."""
    private = DatasetSplits(name=private_name, source_split="train", train=None, val=None,  # type: ignore[arg-type]
                            test=None, num_features=1, num_classes=2, fingerprint="")  # type: ignore[arg-type]
    origin = ticket_origin(winner, private, assert_public=False)
    return PrivacyLedger(phase1=origin.phase1, phase1_dataset=origin.phase1_dataset, private_dataset=private_name,
                         selection_eps1=origin.selection_eps1, training=None, delta=1e-5,
                         data_independent_selection=origin.data_independent_selection,
                         selection_draws=origin.selection_draws)


@pytest.mark.parametrize("name", list(SELECTION_RULES))
def test_every_rule_states_the_event_the_ledger_records(name: str) -> None:
    rule = SELECTION_RULES[name]
    tickets = ticket_set()
    chosen = runnable(rule).select(tickets, settings_for(rule))
    assert 0 <= chosen.selection.index < len(tickets.tickets)
    assert math.isclose(float(np.sum(chosen.selection.probabilities)), 1.0)
    winner = make_winner(tickets, Path("t.pt"), chosen.selection, eps1=settings_for(rule).eps1, nu=NU,
                         seeded=True, method=rule.name, event=chosen.event)
    assert winner.selection_event == chosen.event
    assert winner.selection_method == name
    # tickets made on the private data itself: the ledger records exactly the rule's event
    assert ledger_of(winner, "blobs").selection_event() == chosen.event
    # tickets from other (public) data: no private record was looked at, whatever the rule
    assert ledger_of(winner, "other").selection_event() == NoOpDpEvent()


def test_the_three_rules_of_the_cli_keep_their_events() -> None:
    """As before the registry: ZCDp(ε1²/8) (Cesar & Rogers 2021), and NonPrivate for both free picks."""
    assert SELECTION_RULES["exponential"].event(EPS1) == ZCDpEvent(EPS1 * EPS1 / 8.0)
    assert SELECTION_RULES["best"].event() == NonPrivateDpEvent()
    assert SELECTION_RULES["noise-aware"].event() == NonPrivateDpEvent()
    assert SELECTION_RULES["random"].event() == NoOpDpEvent()


def test_exponential_draws_follow_the_stated_probabilities() -> None:
    rule, tickets = selection_rule("exponential"), ticket_set()
    draws = [rule.select(tickets, RuleSettings(nu=NU, seed=seed, eps1=EPS1)).selection for seed in range(4000)]
    stated = draws[0].probabilities
    scores = np.array(ACCURACIES) * (1 - NU * np.array(DENSITIES))
    assert np.allclose(stated, selection_probabilities(scores, EPS1, 1 - NU * min(DENSITIES)))
    assert 0.05 < stated.min() and stated.max() < 0.9  # a test that can tell the rule from argmax or uniform
    counts = np.bincount([d.index for d in draws], minlength=len(stated))
    assert chisquare(counts, stated * len(draws)).pvalue > 1e-3


def test_a_rule_needs_what_it_declares() -> None:
    with pytest.raises(DpltmUserError, match="unknown selection rule 'nope'.*exponential"):
        selection_rule("nope")
    with pytest.raises(DpltmUserError, match="give --eps1"):
        selection_rule("exponential").select(ticket_set(), RuleSettings(nu=NU))
    with pytest.raises(DpltmUserError, match="drop --eps1"):
        selection_rule("best").select(ticket_set(), RuleSettings(nu=NU, eps1=1.0))
    with pytest.raises(DpltmUserError, match="planned private run"):
        selection_rule("noise-aware").select(ticket_set(), RuleSettings(nu=NU))
    forged = dataclasses.replace(select_best(ticket_set(), RuleSettings(nu=NU)), record={"dp_event": {}})
    with pytest.raises(ValueError, match="overwrite.*dp_event"):  # a rule's record cannot rewrite its privacy
        make_winner(ticket_set(), Path("t.pt"), forged, eps1=None, nu=NU, seeded=True)


# ---- a rule added by this file alone ---------------------------------------------------------


def gumbel_max(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """Report-noisy-max with Gumbel(2Δ/ε1) noise: the exponential mechanism by another algorithm
    (McSherry & Talwar 2007; Durfee & Rogers 2019), so ε1-DP and ε1-bounded-range like it."""
    scores = np.array([t.val_accuracy * (1 - settings.nu * t.density) for t in tickets.tickets])
    sensitivity = float(np.max(np.abs(1 - settings.nu * np.array([t.density for t in tickets.tickets]))))
    eps1 = float(settings.eps1)  # type: ignore[arg-type]
    noisy = scores + np.random.default_rng(settings.seed).gumbel(scale=2 * sensitivity / eps1, size=len(scores))
    probabilities = selection_probabilities(scores, eps1, sensitivity)
    return Selection(int(np.argmax(noisy)), scores, probabilities, sensitivity, False, math.nan,
                     record={"noise_aware": None, "algorithm": "Gumbel report-noisy-max"})


def test_a_rule_registered_here_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                cli: Callable[..., Any]) -> None:
    write_digits(tmp_path)
    cli("generate", "--dataset", "digits", "--data-dir", tmp_path, "--rounds", "2", "--iterations", "15",
        "--batch-size", "16", "--device", "cpu", "--no-progress", "--out", tmp_path / "t.pt")
    monkeypatch.setitem(SELECTION_RULES, "gumbel", SelectionRule("gumbel", f"{__name__}:gumbel_max",
                                                                 spends_eps1=True))
    winner, target = stage_select({"select": {"eps1": 0.5, "nu": 0.5}}, None, tmp_path / "t.pt", False, 7,
                                  tmp_path / "w.pt", rule="gumbel")
    stored = load_checkpoint(target, "ticket")
    selection = stored["selection"]
    assert selection["method"] == "gumbel" and selection["algorithm"] == "Gumbel report-noisy-max"
    assert event_from_json(selection["dp_event"]) == ZCDpEvent(0.5 * 0.5 / 8.0)
    assert selection["eps1"] == 0.5 and selection["draws"] == 1
    assert load_checkpoint(tmp_path / "t.pt", "tickets")["selection_draws"] == [0.5]  # the draw is counted
    ledger = ledger_of(winner, "digits")
    assert ledger.selection_eps1 == 0.5 and ledger.selection_event() == ZCDpEvent(0.5 * 0.5 / 8.0)
    assert winner.round == stored["round"]  # stage_select returns the typed Winner


def test_select_rule_picks_a_registered_rule_by_name_and_checks_its_needs(tmp_path: Path,
                                                                          cli: Callable[..., Any]) -> None:
    """`select --rule NAME` reaches every rule of the registry; the options a rule cannot use are one line."""
    write_digits(tmp_path)
    cli("generate", "--dataset", "digits", "--data-dir", tmp_path, "--rounds", "2", "--iterations", "15",
        "--batch-size", "16", "--device", "cpu", "--no-progress", "--out", tmp_path / "t.pt")
    cli("select", "--rule", "random", "--tickets", tmp_path / "t.pt", "--seed", "3", "--out", tmp_path / "w.pt")
    selection = load_checkpoint(tmp_path / "w.pt", "ticket")["selection"]
    assert selection["method"] == "random" and event_from_json(selection["dp_event"]) == NoOpDpEvent()
    for args, message in ((["--rule", "random", "--eps1", "0.5"], "the random selection spends no ε1"),
                          (["--rule", "best", "--best"], "--rule best is the choice: drop --best/--noise-aware"),
                          (["--rule", "noise-aware"], "--rule noise-aware needs --private-size N"),
                          (["--rule", "random", "--private-size", "100"], "describe the planned run"),
                          (["--rule", "bogus"], "'bogus' is not one of")):
        refused = cli("select", *args, "--tickets", tmp_path / "t.pt", "--out", tmp_path / "x.pt", ok=False)
        lines = refused.stderr.strip().splitlines()
        assert refused.exit_code == 2 and message in refused.stderr, (args, refused.output)
        assert not (tmp_path / "x.pt").exists()
        assert len(lines) <= 1 or "Usage" in refused.stderr, (args, lines)


def _best_winner_named(dataset: str, fingerprint: str) -> Winner:
    """The best-score winner of `ticket_set()`, its source data renamed (by hand, or one set of files under two
    names)."""
    rule = SELECTION_RULES["best"]
    tickets = ticket_set()
    chosen = runnable(rule).select(tickets, settings_for(rule))
    winner = make_winner(tickets, Path("t.pt"), chosen.selection, eps1=None, nu=NU, seeded=True, method=rule.name,
                         event=chosen.event)
    return dataclasses.replace(winner, source={**winner.source, "data": {**winner.source_data, "dataset": dataset,
                                                                          "fingerprint": fingerprint}})


def test_tickets_that_name_another_dataset_but_hold_the_private_fingerprint_are_same_data() -> None:
    """The name decides which data the tickets saw, and the fingerprint backs it: a tickets file renamed to
    another dataset (by hand, or one set of files under two names) but made on the private data is not
    public, so the run is not end-to-end DP."""
    winner = _best_winner_named("imagenet", "fp-of-digits")
    private = DatasetSplits(name="digits", source_split="train", train=None, val=None,  # type: ignore[arg-type]
                            test=None, num_features=1, num_classes=2, fingerprint="fp-of-digits")  # type: ignore[arg-type]
    assert ticket_origin(winner, private, assert_public=False).phase1 == "same-data"
    other = dataclasses.replace(private, fingerprint="fp-of-other-data")
    assert ticket_origin(winner, other, assert_public=False).phase1 == "public"


def _records(rows: list[list[float]], labels: list[int]) -> LabeledTensors:
    return LabeledTensors(torch.tensor(rows), torch.tensor(labels))


def test_tickets_from_another_dataset_are_checked_record_by_record() -> None:
    """Tickets named after another dataset (two user files sharing records) are checked whenever their data
    was reloaded: a shared private training record refuses them in one line; none shared is public with no
    caveat; data that could not be reloaded leaves the reason in the guarantee's caveat."""
    winner = _best_winner_named("their-csv", "fp-their")
    mine = _records([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [0, 1, 0])
    private = DatasetSplits(name="my-csv", source_split="train", train=mine, val=mine, test=mine,
                            num_features=2, num_classes=2, fingerprint="fp-mine")
    sharing = DatasetSplits(name="their-csv", source_split="train", train=_records([[2.0, 3.0], [9.0, 9.0]], [1, 0]),
                            val=_records([[4.0, 5.0]], [0]), test=mine, num_features=2, num_classes=2,
                            fingerprint="fp-their")
    with pytest.raises(DpltmUserError, match=r"their-csv \(train split\), which includes 2 of the private training "
                                             r"records of my-csv") as refused:
        ticket_origin(winner, private, assert_public=False, ticket_data=sharing)
    assert "\n" not in str(refused.value)
    disjoint = dataclasses.replace(sharing, train=_records([[7.0, 7.0]], [1]), val=_records([[8.0, 8.0]], [0]))
    origin = ticket_origin(winner, private, assert_public=False, ticket_data=disjoint)
    assert origin.phase1 == "public" and origin.caveat is None and "no private training record" in origin.explanation
    unchecked = ticket_origin(winner, private, assert_public=False, unchecked="their-csv.csv does not exist")
    assert unchecked.phase1 == "public" and "their-csv.csv does not exist" in (unchecked.caveat or "")


def test_the_newest_ticket_set_is_never_passed_over_unseen_when_a_newer_file_is_damaged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from dpltm.selection.winner import newest_ticket_set

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    with pytest.raises(DpltmUserError, match="no ticket set in"):
        newest_ticket_set(folder)
    (folder / "zz-tickets.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DpltmUserError, match=r"zz-tickets.pt could not be read: damaged\?"):
        newest_ticket_set(folder)
    old = folder / "old.pt"
    old.write_bytes(b"")
    os.utime(old, (1, 1))
    with pytest.raises(DpltmUserError, match="zz-tickets.pt, old.pt could not be read"):
        newest_ticket_set(folder)
    import dpltm.selection.winner as winner

    real = winner.load_ticket_set
    try:  # old.pt read as a ticket set: the damaged newer file still stops the fall-back
        winner.load_ticket_set = lambda path: {} if path.name == "old.pt" else real(path)  # type: ignore[assignment]
        with pytest.raises(DpltmUserError, match="zz-tickets.pt is newer than the ticket set .*old.pt but cannot be"):
            newest_ticket_set(folder)
        (folder / "zz-tickets.pt").unlink()
        assert newest_ticket_set(folder) == old
    finally:
        winner.load_ticket_set = real  # type: ignore[assignment]
