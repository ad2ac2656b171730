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
from dataclasses import dataclass, replace
from typing import Any

from dpltm.errors import DpltmUserError
from dpltm.privacy.events import DpEvent, dpsgd_event
from dpltm.privacy.ledger import training_record


@dataclass(frozen=True)
class Segment:
    """`steps` DP-SGD steps at one mechanism: sampling rate q, noise multiplier σ, clip norm, expected
    batch size L and dataset size N (q = L/N)."""

    q: float
    sigma: float
    clip: float
    expected_batch_size: float
    dataset_size: int
    steps: int = 0

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Segment:
        """A segment from its plain-data record (a checkpoint's), checked."""
        if not isinstance(record, Mapping):
            raise DpltmUserError("a spent segment must be a mapping with q, sigma, steps, clip, expected_batch_size "
                                 "and dataset_size")
        missing = [k for k in ("q", "sigma", "steps", "clip", "expected_batch_size", "dataset_size")
                   if k not in record]
        if missing:
            raise DpltmUserError(f"a spent segment lacks {sorted(set(missing))}")
        steps = record["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise DpltmUserError(f"a spent segment's steps must be a non-negative integer, got {steps!r}")
        segment = cls(float(record["q"]), float(record["sigma"]), float(record["clip"]),
                      float(record["expected_batch_size"]), int(record["dataset_size"]), steps)
        dpsgd_event(segment.q, segment.sigma, max(steps, 1))  # validates q and σ
        return segment

    def same_mechanism(self, other: Segment) -> bool:
        return replace(self, steps=0) == replace(other, steps=0)

    def record(self) -> dict[str, float | int]:
        """The segment as plain data (a `training_record`, what ledgers and checkpoints hold)."""
        return training_record(self.q, self.sigma, self.steps, self.clip, self.expected_batch_size,
                               self.dataset_size)


def _merged(segments: list[Segment], segment: Segment) -> list[Segment]:
    """`segments` then `segment`, merged into the last one where the mechanism is equal."""
    if segments and segments[-1].same_mechanism(segment):
        return [*segments[:-1], replace(segments[-1], steps=segments[-1].steps + segment.steps)]
    return [*segments, segment]


class SpentSegments:
    """The (q, σ, clip, L, N, steps) segments of one run on one private dataset, in the order they ran."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self._segments: list[Segment] = []
        self._latest: Segment | None = None
        self._open: Segment | None = None
        for record in records:
            segment = Segment.of(record)
            if segment.steps > 0:
                self._segments = _merged(self._segments, segment)

    def begin(self, q: float, sigma: float, clip: float, expected_batch_size: float, dataset_size: int) -> None:
        """A new stretch of steps at this mechanism starts (a fit, a resume)."""
        self.end()
        self._open = self._latest = Segment.of({"q": q, "sigma": sigma, "steps": 0, "clip": clip,
                                                "expected_batch_size": expected_batch_size,
                                                "dataset_size": dataset_size})

    def count_step(self) -> None:
        """One step of the open segment ran (call it after the noisy update, once per step)."""
        if self._open is None:
            raise RuntimeError("no segment is open: call begin() first")
        self._open = replace(self._open, steps=self._open.steps + 1)

    def end(self) -> None:
        """Close the open segment (its steps stay counted)."""
        if self._open is not None and self._open.steps > 0:
            self._segments = _merged(self._segments, self._open)
        self._open = None

    def records(self) -> list[dict[str, float | int]]:
        """Every segment with at least one step, the open one included, merged where the mechanism is equal."""
        segments = self._segments
        if self._open is not None and self._open.steps > 0:
            segments = _merged(segments, self._open)
        return [segment.record() for segment in segments]

    def note_mechanism(self, record: Mapping[str, Any]) -> None:
        """Restore `latest_mechanism` (a reloaded run that took no step), checked as a segment is."""
        self._latest = Segment.of({**record, "steps": 0})

    @property
    def latest_mechanism(self) -> dict[str, float | int] | None:
        """The mechanism of the segment begun last, open or ended, with its steps so far (0 included)."""
        latest = self._open if self._open is not None else self._latest
        return None if latest is None else latest.record()

    @property
    def steps(self) -> int:
        return sum(segment.steps for segment in self._segments) + self.open_steps

    @property
    def open_steps(self) -> int:
        """Steps taken in the open segment (this fit) so far."""
        return 0 if self._open is None else self._open.steps

    def events(self) -> list[DpEvent]:
        """One `SelfComposed(PoissonSampled(q, Gaussian(σ)), T)` per segment, in order."""
        return [dpsgd_event(r["q"], r["sigma"], int(r["steps"])) for r in self.records()]

    def state(self) -> list[dict[str, float | int]]:
        """Plain data for a checkpoint: the segments, never a seed or a generator state."""
        return self.records()
