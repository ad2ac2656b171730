"""The selection rules of phase 2 and what each can do: the one list `dpltm select` reads.

Adding a selection rule: one function `(TicketSet, RuleSettings) -> Selection` (like those in
dpltm/selection/winner.py) and one `SelectionRule` line below. `stage_select` picks a rule by name, the
winner file records its name as `selection.method`, its privacy event is derived from the capabilities it
declares (`SelectionRule.event`), and the training ledger reads the same capabilities back from that name
(dpltm.training.pipeline.ticket_origin), so the winner file and the ledger cannot disagree. The shared
suite in tests/selection/test_selection_rules.py runs every entry. This module imports nothing heavy (no torch, no
numpy), like dpltm.dp.noise, so a front end may list the rules cheaply; a rule's function is imported
when it is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.errors import DpltmUserError

if TYPE_CHECKING:
    from dp_accounting import DpEvent  # type: ignore[import-untyped]


@dataclass(frozen=True)
class RuleSettings:
    """What a rule may use besides the ticket set; each rule reads only its own fields."""

    nu: float
    """ν of the paper's score S = A·(1 − ν·C)."""
    seed: int | None = None
    """Seeds the rule's randomness (reproducible, not secret); None: the OS CSPRNG."""
    eps1: float | None = None
    """The selection budget, for a rule that spends ε1 (and only for one)."""
    planned_run: Any = None
    """For a rule that needs the planned private run: a `dpltm.stages.select.NoiseAwareRequest`."""
    config: Path | None = None
    """The config file the planned run is resolved with (--config)."""
    halving: int = 0
    """Rungs of successive halving, for a rule that trains candidates (the noise-aware choice)."""
    search: tuple[str, ...] = ()
    """What the noise-aware choice searches besides the ticket (dpltm.settings.SEARCHABLE)."""


@dataclass(frozen=True)
class Chosen:
    """A rule's answer: the winner (index, scores, probabilities, the rule's own record) and what the
    pick cost on the ticket data, taken as private (the winner file's `dp_event`)."""

    selection: Any
    """A `dpltm.selection.winner.Selection` (not imported here: it needs numpy)."""
    event: DpEvent


@dataclass(frozen=True)
class SelectionRule:
    name: str
    """Also the winner file's `selection.method`: renaming a rule orphans the winners written under it."""
    target: str
    """`module:function`, `(TicketSet, RuleSettings) -> Selection`, imported on first use."""
    spends_eps1: bool = False
    """Its pick is ε1-DP and ε1-bounded-range on the ticket data, like the exponential mechanism (McSherry &
    Talwar 2007, Thm 6; Durfee & Rogers 2019): the ledger records it as ε1²/8-zCDP (Cesar & Rogers 2021) and
    composes every draw from the same ticket set, so each draw is recorded in the ticket file first."""
    touches_ticket_data: bool = True
    """Its pick looks at the ticket data (scores measured on it, candidates trained on it), the private
    data when the tickets were made on it: without ε1 the pick is then non-private. A rule that does not
    (a uniformly random ticket) is a NoOp even among same-data tickets."""
    needs_planned_run: bool = False
    """It needs the planned private run (σ, L, T, the private set's size: `RuleSettings.planned_run`) and
    reloads the tickets' own data as public data."""
    title: str = "selection over {k} tickets, S = A·(1 − {nu:g}·C)"
    """The table's title (`k` tickets, `nu`)."""
    score_name: str = "score S"
    note: str | None = None
    """Printed under the table (a rule spending ε1 prints ε1, Δ and how close to uniform instead)."""
    spend: str = ""
    """How `select` states what the pick spent (a rule spending ε1 states its ε1 instead)."""

    def load(self) -> Any:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)

    def event(self, eps1: float | None = None) -> DpEvent:
        """The pick's DpEvent on the ticket data taken as private, from the declared capabilities alone:
        `ZCDpEvent(ε1²/8)` (dpltm.privacy.events.selection_event), NonPrivate, or NoOp. The ledger derives
        its selection event from the same capabilities (and makes it a NoOp for public tickets)."""
        from dp_accounting import NonPrivateDpEvent, NoOpDpEvent

        if self.spends_eps1:  # imported by name, as `load` does: dpltm.privacy.events needs numpy
            events = importlib.import_module("dpltm.privacy.events")
            return events.selection_event(eps1)  # check_eps1 refuses None
        return NonPrivateDpEvent() if self.touches_ticket_data else NoOpDpEvent()

    def select(self, tickets: Any, settings: RuleSettings) -> Chosen:
        """The winner of the ticket set `tickets` (a `dpltm.artefacts.TicketSet`: named, not imported, since the
        catalogue stays torch- and numpy-free) and its DpEvent."""
        if self.spends_eps1 != (settings.eps1 is not None):
            raise DpltmUserError(f"the {self.name} selection " + ("spends ε1: give --eps1" if self.spends_eps1 else
                                                                  "spends no ε1: drop --eps1"))
        if self.needs_planned_run and settings.planned_run is None:
            raise DpltmUserError(f"the {self.name} selection needs the planned private run (--private-size …)")
        return Chosen(self.load()(tickets, settings), self.event(settings.eps1))


_SAME_DATA = "(if the ticket data is your private data, this selection is non-private)"

SELECTION_RULES: dict[str, SelectionRule] = {rule.name: rule for rule in (
    SelectionRule("exponential", "dpltm.selection.winner:select_exponential", spends_eps1=True),
    SelectionRule("best", "dpltm.selection.winner:select_best",
                  note="non-private pick (--best): the highest score, no privacy spent on the ticket data.",
                  spend=f"no privacy: the best score, for tickets from public data {_SAME_DATA}"),
    SelectionRule("noise-aware", "dpltm.selection.winner:select_noise_aware", needs_planned_run=True,
                  title="noise-aware choice over {k} tickets: public validation accuracy after the planned DP "
                        "training",
                  score_name="acc. under planned noise",
                  spend="no privacy: under the planned noise, the dense network unless a ticket beats it by more "
                        "than 2 standard errors on the public validation records, then the best such ticket "
                        f"{_SAME_DATA}"),
    SelectionRule("random", "dpltm.selection.winner:select_random", touches_ticket_data=False,
                  note="uniformly random pick: the ticket data is not looked at, no privacy spent on it.",
                  spend="no privacy: a uniformly random ticket, chosen without looking at the ticket data"),
)}


def selection_rule(name: str) -> SelectionRule:
    """The rule called `name`; an unknown name is one line listing the others."""
    try:
        return SELECTION_RULES[name]
    except KeyError:
        raise DpltmUserError(f"unknown selection rule '{name}' (choose from {', '.join(SELECTION_RULES)})") from None
