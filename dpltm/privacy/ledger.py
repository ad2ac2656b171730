"""The privacy record of a run: stored in checkpoints, printed to users.

A `PrivacyLedger` says what touched the private data and how (docs/privacy.md §1):

* phase 1 (ticket generation) by DP-SGD on the private data itself (`dpltm generate --private`:
  a DP warm-up, masks by magnitude of the DP weights, docs/privacy.md §7) is recorded as one
  `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)` per warm-up round; the run stays end-to-end
  DP and its ε composes every warm-up round with training in one PLD (or RDP) computation.
* phase 1 (ticket generation) on the SAME private data is recorded as
  `NonPrivateDpEvent`: its masks leak (the winner's zero pattern is visible in the released
  weights), so the paper's Theorem 3 (ε = ε1 + ε2) does not hold and the run is not
  end-to-end DP (overall ε = ∞). On public data it is `NoOpDpEvent`.
* phase 2 (selection) is `ZCDpEvent(ε1²/8)` when the exponential mechanism ran on private
  data, `NoOpDpEvent` when it touched none (public tickets chosen on public data), and
  `NonPrivateDpEvent` for a non-private pick among same-data tickets.
* phase 3 (training) is `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)`, or
  `NonPrivateDpEvent` when training was not private.

The ε reported for the DP part (selection and training) is the best valid bound of
`accounting.composition_bounds`; when the run is not end-to-end DP the report says so and
gives the overall ε as infinite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from dp_accounting import (  # type: ignore[import-untyped]
    ComposedDpEvent,
    NonPrivateDpEvent,
    NoOpDpEvent,
)

from dpltm.dp.noise import NOISE_PLUGINS
from dpltm.errors import DpltmUserError
from dpltm.privacy.accountants import ACCOUNTANTS
from dpltm.privacy.accounting import (
    BASIC_COMPOSITION,
    NEIGHBORING,
    NEIGHBORING_LABELS,
    RDP_COMPOSITION,
    TRAINING_ONLY,
    Bound,
    best_bound,
    check_accountant,
    check_delta,
    composition_bounds,
)
from dpltm.privacy.display import format_delta, format_epsilon, format_rate, format_sigma, round_up
from dpltm.privacy.events import (
    DpEvent,
    dpsgd_event,
    event_from_json,
    event_to_json,
    selection_event,
)

FORMAT_VERSION = 1
PHASE1_MODES = ("public", "same-data", "private", "none")
NOISES = tuple(NOISE_PLUGINS)
"""Noise plug-ins a ledger may name (dpltm/dp/noise.py). Each reduces exactly to the
Poisson-subsampled Gaussian mechanism with the *effective* multiplier that `training` records as
sigma, so the accounting does not depend on which one ran."""
_NOISE_TEXT = {name: plugin.statement for name, plugin in NOISE_PLUGINS.items()}
TRAINING_REQUIRED = ("q", "sigma", "steps")
PRIVATE_TICKET_COMPOSITION = "private-ticket-composition"
TRAINING_OPTIONAL = ("clip", "expected_batch_size", "dataset_size")

_COMPOSITION_TEXT = {
    TRAINING_ONLY: "training only (no ε1 spent on selection)",
    PRIVATE_TICKET_COMPOSITION: "DP ticket generation + training (every DP-SGD phase in one composition)",
    BASIC_COMPOSITION: "basic (ε1 + ε_train)",
    RDP_COMPOSITION: "RDP (selection as ε1²/8-zCDP + training)",
}


def training_record(
    q: float,
    sigma: float,
    steps: int,
    clip: float | None = None,
    expected_batch_size: float | None = None,
    dataset_size: int | None = None,
) -> dict[str, float | int]:
    """The `training` dict of a ledger, with only the keys that are known."""
    out: dict[str, float | int] = {"q": float(q), "sigma": float(sigma), "steps": int(steps)}
    if clip is not None:
        out["clip"] = float(clip)
    if expected_batch_size is not None:
        out["expected_batch_size"] = float(expected_batch_size)
    if dataset_size is not None:
        out["dataset_size"] = int(dataset_size)
    return out


def dpsgd_events(records: Iterable[Mapping[str, Any]]) -> list[DpEvent]:
    """The DP-SGD event of each `training_record`-style record (q, sigma, steps)."""
    return [dpsgd_event(r["q"], r["sigma"], int(r["steps"])) for r in records]


def json_float(value: float) -> float | str:
    """Finite floats as they are; ±∞ as "inf"/"-inf" so reports are strict JSON."""
    if math.isfinite(value):
        return float(value)
    return "inf" if value > 0 else "-inf"


@dataclass(frozen=True)
class PrivacyLedger:
    """What ran on the private data, and the (ε, δ) it supports. See the module docstring.

    `selection_eps1` None means no private selection (public tickets chosen on public
    data, or a non-private `--best` pick). `training` holds q, sigma, steps and optionally
    clip, expected_batch_size, dataset_size (see `training_record`), or is None for
    non-private training.
    """

    phase1: str
    phase1_dataset: str | None
    private_dataset: str
    selection_eps1: float | None
    training: dict[str, float | int] | None
    delta: float
    neighboring: str = "add_remove"
    accountant: str = "pld"
    noise: str = "gaussian"
    data_independent_selection: bool = False
    """True when no ε1 was spent because the pick did not look at the data (a uniformly random
    ticket): the selection is then a NoOp even among same-data tickets."""
    phase1_training: tuple[dict[str, float | int], ...] | None = None
    """phase1 "private": the DP-SGD record (as `training`) of every warm-up round that made the
    ticket on the private data; None otherwise."""
    selection_draws: int = 1
    """Exponential-mechanism draws made from the same ticket set; `selection_eps1` is their sum.
    k draws of ε1_i-DP (each ε1_i-bounded-range) compose to (Σε1_i)-DP and (Σε1_i)-bounded range
    (Dwork & Roth 2014, Thm 3.16; Durfee & Rogers 2019, Lemma 3.3), so the single selection event
    with the sum is a valid, slightly conservative record of all of them."""
    earlier_training: tuple[dict[str, float | int], ...] | None = None
    """DP-SGD segments that ran on the same private data before `training`, at other (q, σ) (a library
    run's earlier fits or resumes; dpltm.privacy.segments), in order. They are composed with
    `training` as they ran (adaptive composition, Dwork & Roth 2014, Thm 3.16), never re-planned."""
    held_out_records: bool = True
    """Whether validation and test records were held out of the private set (the CLI's splits); a
    library run on the user's tensors has none, and its statement must not claim them."""
    non_private_updates: int = 0
    """Optimiser steps that ran on a gradient the mechanism did not clip and noise (a library run whose
    module stepped its optimiser itself): the weights then carry a release with no DP guarantee, so the run
    is not DP at all (a NonPrivateDpEvent in the tree); the ε of its DP steps is reported only as such."""

    def __post_init__(self) -> None:
        if isinstance(self.non_private_updates, bool) or not isinstance(self.non_private_updates, int) \
                or self.non_private_updates < 0:
            raise DpltmUserError(f"non_private_updates must be a count, got {self.non_private_updates!r}")
        if self.phase1 not in PHASE1_MODES:
            raise DpltmUserError(f"phase1 must be one of {PHASE1_MODES}, got {self.phase1!r}")
        if self.phase1 == "none" and self.selection_eps1 is not None:
            raise DpltmUserError("a run without tickets (phase1 'none') has no selection eps1")
        if self.selection_eps1 is not None:
            e = float(self.selection_eps1)
            if not (math.isfinite(e) and e > 0.0):
                raise DpltmUserError(f"selection eps1 must be positive and finite, got {e}")
            object.__setattr__(self, "selection_eps1", e)
        if isinstance(self.selection_draws, bool) or not isinstance(self.selection_draws, int) \
                or self.selection_draws < 1:
            raise DpltmUserError(f"selection_draws must be a positive integer, got {self.selection_draws!r}")
        object.__setattr__(self, "delta", check_delta(self.delta))
        if self.neighboring not in NEIGHBORING:  # stored in the accountants' spelling only
            raise DpltmUserError(f"neighboring must be one of {NEIGHBORING}, got {self.neighboring!r}")
        check_accountant(self.accountant)
        if self.noise not in NOISES:
            raise DpltmUserError(f"noise must be one of {NOISES}, got {self.noise!r}")
        if self.training is not None:
            object.__setattr__(self, "training", self._checked_training(self.training))
        if (self.phase1 == "private") != bool(self.phase1_training):
            raise DpltmUserError("phase1 'private' needs the DP record of its warm-up rounds (phase1_training), "
                                 "and only it has one")
        if self.phase1_training:
            object.__setattr__(self, "phase1_training",
                               tuple(self._checked_training(r) for r in self.phase1_training))
        if self.earlier_training:
            if self.training is None:
                raise DpltmUserError("earlier DP-SGD segments need the training record they precede")
            object.__setattr__(self, "earlier_training",
                               tuple(self._checked_training(r) for r in self.earlier_training))
        else:
            object.__setattr__(self, "earlier_training", None)

    @staticmethod
    def _checked_training(training: Mapping[str, Any]) -> dict[str, float | int]:
        missing = [k for k in TRAINING_REQUIRED if k not in training]
        unknown = sorted(set(training) - set(TRAINING_REQUIRED) - set(TRAINING_OPTIONAL))
        if missing or unknown:
            raise DpltmUserError(
                f"training record needs {list(TRAINING_REQUIRED)} (optional "
                f"{list(TRAINING_OPTIONAL)}); missing {missing}, unknown {unknown}"
            )
        rec = training_record(**{k: training[k] for k in training})
        dpsgd_event(rec["q"], rec["sigma"], int(rec["steps"]))  # validates q, sigma, steps
        n, batch = rec.get("dataset_size"), rec.get("expected_batch_size")
        if n is not None and batch is not None and not math.isclose(
            rec["q"], batch / n, rel_tol=1e-9
        ):
            raise DpltmUserError(
                f"training q = {format_rate(rec['q'])} disagrees with expected_batch_size/dataset_size "
                f"= {batch:g}/{n}"
            )
        return rec

    # ---- events ----------------------------------------------------------------------------

    def phase1_event(self) -> DpEvent:
        """Same-data tickets leak (docs/privacy.md §1): NonPrivate; DP tickets: their warm-up rounds'
        DP-SGD events; public or none: NoOp."""
        if self.phase1 == "private":
            return ComposedDpEvent(self._warmup_events())
        return NonPrivateDpEvent() if self.phase1 == "same-data" else NoOpDpEvent()

    def _warmup_events(self) -> list[DpEvent]:
        return dpsgd_events(self.phase1_training or ())

    def selection_event(self) -> DpEvent:
        """ε1-DP exponential mechanism as ε1²/8-zCDP; NoOp when no private data was used."""
        if self.selection_eps1 is not None:
            return selection_event(self.selection_eps1)
        # A non-private pick among tickets built and scored on the private data.
        if self.phase1 == "same-data" and not self.data_independent_selection:
            return NonPrivateDpEvent()
        return NoOpDpEvent()

    @property
    def epsilon_scope(self) -> str:
        """What the reported ε covers: it must never claim a phase that was not DP."""
        if self.training is None:
            return "nothing (training was not private)"
        if self.non_private_updates:
            return (f"the DP steps only; {self.non_private_updates} optimiser step(s) on gradients that were not "
                    "clipped and noised also ran")
        if self.end_to_end_dp:
            return "whole run"
        if isinstance(self.selection_event(), NonPrivateDpEvent):
            return "training only (phase 3), given the ticket chosen without privacy"
        return "selection and training only (phases 2-3)"

    def training_event(self) -> DpEvent:
        """Training's DP-SGD event; with earlier segments, all of them composed in the order they ran."""
        if self.training is None:
            return NonPrivateDpEvent()
        t = self.training
        last = dpsgd_event(t["q"], t["sigma"], int(t["steps"]))
        if self.earlier_training:
            return ComposedDpEvent([*dpsgd_events(self.earlier_training), last])
        return last

    def dp_event(self) -> DpEvent:
        """The whole run: `ComposedDpEvent([phase 1, selection, training])`."""
        events = [self.phase1_event(), self.selection_event(), self.training_event()]
        return ComposedDpEvent(events + [NonPrivateDpEvent()] * bool(self.non_private_updates))

    # ---- guarantees ------------------------------------------------------------------------

    @property
    def end_to_end_dp(self) -> bool:
        """False when tickets came from the private data without privacy, or training was not DP."""
        return self.phase1 != "same-data" and self.training is not None and not self.non_private_updates

    def bounds(self) -> list[Bound]:
        """Every valid bound for selection + training (`accounting.composition_bounds`).

        Cheap to call again: `accounting.epsilon` caches on the event.
        """
        if self.phase1 != "private":
            return composition_bounds(self.selection_eps1, self.training_event(), self.delta, self.accountant,
                                      self.neighboring)
        # A DP ticket: every DP-SGD phase on the private data (warm-up rounds, then training) is
        # composed in one accountant computation (adaptive composition, Dwork & Roth 2014, Thm 3.16;
        # exact PLD composition, Meiser & Mohammad 2018), not summed.
        dp_phases = ComposedDpEvent([*self._warmup_events(), self.training_event()])
        return [replace(b, name=PRIVATE_TICKET_COMPOSITION if b.name == TRAINING_ONLY else b.name,
                        description="DP ticket generation (warm-up) and training composed by the "
                                    f"{ACCOUNTANTS[self.accountant].label} accountant" if b.name == TRAINING_ONLY
                        else b.description)
                for b in composition_bounds(self.selection_eps1, dp_phases, self.delta, self.accountant,
                                            self.neighboring)]

    def best_bound(self) -> Bound:
        return best_bound(self.bounds())

    @property
    def overall_epsilon(self) -> float:
        """ε of the whole run: ∞ unless end-to-end DP (dp-accounting: NonPrivate ⇒ ε = ∞)."""
        return self.best_bound().epsilon if self.end_to_end_dp else math.inf

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε of the whole run at `delta` (None: the run's own δ), as Opacus's accountants answer it: the same
        events and accountant, only the δ at which their privacy curve is read changes (every (ε(δ), δ) on the
        curve holds at once: Dwork & Roth 2014, Def. 2.4). ∞ unless end-to-end DP."""
        if delta is None:
            return self.overall_epsilon
        return replace(self, delta=check_delta(delta)).overall_epsilon

    def warning(self) -> str | None:
        if self.non_private_updates:
            return (
                f"NOT differentially private: {self.non_private_updates} update(s) outside DP-SGD touched "
                f"{self.private_dataset}'s model (an optimiser step on gradients that were not clipped and noised, "
                "or weights or buffers written during a training step); overall epsilon is infinite."
            )
        if self.training is None:
            return (
                f"NOT differentially private: training ran without privacy on the private "
                f"data ({self.private_dataset}); overall epsilon is infinite."
            )
        if self.phase1 == "same-data":
            return (
                f"NOT end-to-end differentially private: tickets were generated without "
                f"privacy on the private training data ({self.private_dataset}); the ε below "
                f"covers {self.epsilon_scope}; overall epsilon is infinite."
            )
        return None

    def report(self) -> dict[str, Any]:
        """Strict-JSON summary (∞ written as "inf"): ε, δ, how it was derived, every bound."""
        best = self.best_bound()
        return {
            "format_version": FORMAT_VERSION,
            "end_to_end_dp": self.end_to_end_dp,
            "epsilon": json_float(best.epsilon),
            "epsilon_scope": self.epsilon_scope,
            "overall_epsilon": json_float(self.overall_epsilon),
            "delta": self.delta,
            "neighboring": self.neighboring,
            "accountant": self.accountant,
            "composition": best.name,
            "bounds": [{**asdict(b), "epsilon": json_float(b.epsilon)} for b in self.bounds()],
            "phase1": self.phase1,
            "phase1_dataset": self.phase1_dataset,
            "private_dataset": self.private_dataset,
            "selection_eps1": self.selection_eps1,
            "selection_draws": self.selection_draws,
            "training": dict(self.training) if self.training is not None else None,
            "phase1_training": None if self.phase1_training is None else [dict(r) for r in self.phase1_training],
            "earlier_training": None if self.earlier_training is None else [dict(r) for r in self.earlier_training],
            "noise": self.noise,
            "non_private_updates": self.non_private_updates,
            "warning": self.warning(),
        }

    def statement(self) -> str:
        """Plain-English lines for the terminal. ε is rounded up, never down."""
        best = self.best_bound()
        lines: list[str] = []
        warning = self.warning()
        if warning is not None:
            lines.append(warning)
        relation = NEIGHBORING_LABELS[self.neighboring]
        lines.append(
            f"(ε = {round_up(best.epsilon)}, δ = {format_delta(self.delta)})-DP for {self.private_dataset} "
            f"under {relation} adjacency, {ACCOUNTANTS[best.accountant].label} accountant, "
            f"composition: {_COMPOSITION_TEXT.get(best.name, best.name)}"
            + ("" if self.end_to_end_dp else f" [{self.epsilon_scope}]")
            + "."
        )
        if self.training is not None and "dataset_size" in self.training:
            lines.append(
                f"Protected: the {int(self.training['dataset_size'])} training records of "
                f"{self.private_dataset} (their number N is treated as public: q = L/N, and settings chosen from "
                "N, such as --recipe auto's, depend on it)."
                + (" Validation and test records are held out; their accuracies are reported without privacy."
                   if self.held_out_records else "")
            )
        if self.selection_eps1 is not None and self.selection_draws > 1:
            lines.append(f"Selection: exponential mechanism, {self.selection_draws} draws from the same tickets, "
                         f"ε1 = {format_epsilon(self.selection_eps1)} in all (basic composition of the draws).")
        elif self.selection_eps1 is not None:
            lines.append(f"Selection: exponential mechanism, ε1 = {format_epsilon(self.selection_eps1)}.")
        if self.phase1 == "private":
            rounds = self.phase1_training or ()
            r0 = rounds[0]
            lines.append(
                f"Ticket: made with privacy on {self.phase1_dataset}: {len(rounds)} DP-SGD warm-up "
                f"round(s) of {int(r0['steps'])} steps (q = {format_rate(r0['q'])}, σ = "
                f"{format_sigma(r0['sigma'])}), masks by "
                "magnitude of the DP weights (post-processing); composed with training above."
            )
        elif self.selection_eps1 is not None:
            pass
        elif self.phase1 == "public":
            lines.append(
                f"Selection: tickets from public data ({self.phase1_dataset}); "
                "no private data spent on choosing one."
            )
        elif self.phase1 == "same-data" and self.data_independent_selection:
            lines.append("Selection: a uniformly random ticket (looks at no data).")
        elif self.phase1 == "same-data":
            lines.append("Selection: non-private pick among tickets from the private data.")
        if self.training is not None:
            t = self.training
            extra = f", clip {t['clip']:g}" if "clip" in t else ""
            lines.append(
                f"Training: DP-SGD with Poisson sampling q = {format_rate(t['q'])}, noise plug-in "
                f"'{self.noise}' ({_NOISE_TEXT.get(self.noise, self.noise)}), "
                f"{'effective ' if self.noise != 'gaussian' else ''}noise multiplier "
                f"σ = {format_sigma(t['sigma'])}, {int(t['steps'])} steps{extra}."
            )
            for k, r in enumerate(self.earlier_training or (), start=1):
                lines.append(
                    f"  Earlier segment {k} (composed above as it ran): q = {format_rate(r['q'])}, σ = "
                    f"{format_sigma(r['sigma'])}, "
                    f"{int(r['steps'])} steps."
                )
        else:
            lines.append("Training: not private.")
        others = [b for b in self.bounds() if b != best]
        for b in others:
            lines.append(
                f"Also valid: ε = {round_up(b.epsilon)} by {_COMPOSITION_TEXT.get(b.name, b.name)}"
                f" ({ACCOUNTANTS[b.accountant].label})."
            )
        return "\n".join(lines)

    # ---- storage ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON dict for a checkpoint, with the DpEvent tree for any future accountant."""
        return {
            "format_version": FORMAT_VERSION,
            "phase1": self.phase1,
            "phase1_dataset": self.phase1_dataset,
            "private_dataset": self.private_dataset,
            "selection_eps1": self.selection_eps1,
            "training": dict(self.training) if self.training is not None else None,
            "delta": self.delta,
            "neighboring": self.neighboring,
            "accountant": self.accountant,
            "noise": self.noise,
            "data_independent_selection": self.data_independent_selection,
            "selection_draws": self.selection_draws,
            "phase1_training": None if self.phase1_training is None else [dict(r) for r in self.phase1_training],
            "earlier_training": None if self.earlier_training is None else [dict(r) for r in self.earlier_training],
            "held_out_records": self.held_out_records,
            "non_private_updates": self.non_private_updates,
            "dp_event": event_to_json(self.dp_event()),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """The ledger `to_json` wrote; the stored DpEvent tree must match the fields."""
        if not isinstance(data, Mapping):
            raise DpltmUserError("privacy record must be a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise DpltmUserError(
                f"privacy record format {version!r} is not supported (expected {FORMAT_VERSION})"
            )
        names = ("phase1", "phase1_dataset", "private_dataset", "selection_eps1", "training",
                 "delta", "neighboring", "accountant", "noise")
        missing = [n for n in names if n not in data]
        if missing:
            raise DpltmUserError(f"privacy record lacks {missing}")
        ledger = cls(**{n: data[n] for n in names},
                     data_independent_selection=bool(data.get("data_independent_selection", False)),
                     selection_draws=data.get("selection_draws", 1),
                     phase1_training=_records(data.get("phase1_training")),
                     earlier_training=_records(data.get("earlier_training")),
                     held_out_records=_flag(data.get("held_out_records", True), "held_out_records"),
                     non_private_updates=data.get("non_private_updates", 0))
        if "dp_event" in data and event_from_json(data["dp_event"]) != ledger.dp_event():
            raise DpltmUserError(
                "privacy record is inconsistent: its DpEvent does not match its fields"
            )
        return ledger


def before_any_step(masked: bool, masks_private: bool, selection_eps1: float | None) -> tuple[float, str]:
    """ε and the statement of a library run that has taken no DP step yet (it has no ledger). Its masks are on
    the model already, so a model released now shows the ticket: masks made on these private records without
    privacy make it not DP (ε = ∞, as `PrivacyLedger` states for phase 1 "same-data"); a ticket chosen on them by
    the exponential mechanism spent ε1, pure ε1-DP and so at every δ (McSherry & Talwar 2007, Thm 6)."""
    if masked and masks_private:
        return math.inf, ("No DP step has run yet, but the masks on the model were made on these private records "
                          "without privacy: NOT differentially private (epsilon is infinite).")
    if masked and selection_eps1 is not None:
        return float(selection_eps1), (f"No DP step has run yet; choosing the ticket on the private records spent "
                                       f"epsilon1 = {format_epsilon(selection_eps1)} (pure epsilon-DP).")
    return 0.0, "No DP step has run yet: nothing spent."


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise DpltmUserError(f"privacy record's {name} must be true or false, got {str(value)[:40]!r}")
    return value


def _records(value: Any) -> tuple[dict[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(r, Mapping) for r in value):
        raise DpltmUserError("privacy record's phase1_training and earlier_training must be lists of DP-SGD records")
    return tuple(dict(r) for r in value)
