"""The DP-SGD segments a run has spent, as they ran: history is composed, never re-planned.

A library run (`make_private`, `DPCallback`) can change its sampling rate q or its noise
multiplier σ between fits or across a resume. What it spent is then the adaptive composition of
every stretch of steps at the (q, σ) it ran at (Dwork & Roth 2014, Thm 3.16), not "all steps at
the latest plan": re-planning σ for the whole run and multiplying by every step done
undercounts whenever an earlier segment had a smaller σ or a larger q (docs/privacy.md §8).

Each segment is one `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)` event; the ledger composes
them in one PLD (or RDP) computation. Consecutive segments with the same mechanism merge (T1 + T2
self-compositions of one mechanism are T1 + T2 of it), so a plain resume adds no event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dpltm.errors import DpltmUserError
from dpltm.privacy.events import DpEvent, dpsgd_event
from dpltm.privacy.ledger import training_record

_SAME_MECHANISM = ("q", "sigma", "clip", "expected_batch_size", "dataset_size")


class SpentSegments:
    """The (q, σ, clip, L, N, steps) segments of one run on one private dataset, in the order they ran."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self._records: list[dict[str, Any]] = []
        self._latest: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None
        for record in records:
            checked = self._checked(record)
            if checked["steps"] > 0:
                self._append(checked)

    @staticmethod
    def _checked(record: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(record, Mapping):
            raise DpltmUserError("a spent segment must be a mapping with q, sigma, steps, clip, expected_batch_size "
                                 "and dataset_size")
        missing = [k for k in ("q", "sigma", "steps", *_SAME_MECHANISM) if k not in record]
        if missing:
            raise DpltmUserError(f"a spent segment lacks {sorted(set(missing))}")
        steps = record["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise DpltmUserError(f"a spent segment's steps must be a non-negative integer, got {steps!r}")
        out = dict(training_record(record["q"], record["sigma"], max(steps, 1), record["clip"],
                                   record["expected_batch_size"], record["dataset_size"]))
        dpsgd_event(out["q"], out["sigma"], int(out["steps"]))  # validates q and σ
        out["steps"] = steps
        return out

    def _append(self, record: dict[str, Any]) -> None:
        last = self._records[-1] if self._records else None
        if last is not None and all(last[k] == record[k] for k in _SAME_MECHANISM):
            last["steps"] += record["steps"]
        else:
            self._records.append(dict(record))

    def begin(self, q: float, sigma: float, clip: float, expected_batch_size: float, dataset_size: int) -> None:
        """A new stretch of steps at this mechanism starts (a fit, a resume)."""
        self.end()
        self._open = self._checked({"q": q, "sigma": sigma, "steps": 0, "clip": clip,
                                    "expected_batch_size": expected_batch_size, "dataset_size": dataset_size})
        self._latest = dict(self._open)

    def count_step(self) -> None:
        """One step of the open segment ran (call it after the noisy update, once per step)."""
        if self._open is None:
            raise RuntimeError("no segment is open: call begin() first")
        self._open["steps"] += 1

    def end(self) -> None:
        """Close the open segment (its steps stay counted)."""
        if self._open is not None and self._open["steps"] > 0:
            self._append(self._open)
        self._open = None

    def records(self) -> list[dict[str, Any]]:
        """Every segment with at least one step, the open one included, merged where the mechanism is equal."""
        out = [dict(r) for r in self._records]
        if self._open is not None and self._open["steps"] > 0:
            last = out[-1] if out else None
            if last is not None and all(last[k] == self._open[k] for k in _SAME_MECHANISM):
                last["steps"] += self._open["steps"]
            else:
                out.append(dict(self._open))
        return out

    def note_mechanism(self, record: Mapping[str, Any]) -> None:
        """Restore `latest_mechanism` (a reloaded run that took no step), checked as a segment is."""
        self._latest = self._checked({**record, "steps": 0})

    @property
    def latest_mechanism(self) -> dict[str, Any] | None:
        """The mechanism of the segment begun last, open or ended, with its steps so far (0 included)."""
        if self._open is not None:
            return dict(self._open)
        return None if self._latest is None else dict(self._latest)

    @property
    def steps(self) -> int:
        return sum(int(r["steps"]) for r in self.records())

    @property
    def open_steps(self) -> int:
        """Steps taken in the open segment (this fit) so far."""
        return 0 if self._open is None else int(self._open["steps"])

    def events(self) -> list[DpEvent]:
        """One `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)` per segment, in order."""
        return [dpsgd_event(r["q"], r["sigma"], int(r["steps"])) for r in self.records()]

    def state(self) -> list[dict[str, Any]]:
        """Plain data for a checkpoint: the segments, never a seed or a generator state."""
        return self.records()
