"""The ε curve computed ahead of training: a signal while it is being queued leaves nothing running."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from dpltm.training.private import EpsilonCurve


class _Stopped(BaseException):
    """Stands in for the Interrupted a signal handler raises."""


def test_a_signal_while_the_curve_is_queued_cancels_what_was_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller never gets the curve to cancel, so the constructor must: otherwise the interpreter's exit
    waits for every queued ε (thousands of PLD computations for a long run)."""
    computed: list[int] = []

    def epsilon_after(steps: int) -> float:
        computed.append(steps)
        time.sleep(0.01)
        return float(steps)

    submitted = [0]
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def interrupted_submit(self, fn, *args):  # type: ignore[no-untyped-def]
        submitted[0] += 1
        if submitted[0] == 50:
            raise _Stopped
        return submit(self, fn, *args)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", interrupted_submit)
    with pytest.raises(_Stopped):
        EpsilonCurve(epsilon_after, list(range(1, 5000)))
    for thread in threading.enumerate():
        if thread.name.startswith("dpltm-epsilon"):
            thread.join(timeout=5)
            assert not thread.is_alive()
    assert len(computed) < 49  # the queued ones were cancelled, not computed
