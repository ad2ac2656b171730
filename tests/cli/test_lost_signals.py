"""A signal whose exception is lost still stops the run: in a finalizer Python reports the handler's exception as
unraisable and carries on, and a library's bare `except:` swallows it. The handler has marked the run as stopping
(further signals are ignored while it unwinds), so the next step or chunk of work raises it again
(`dpltm.errors.raise_if_stopping`), and the lost one prints no traceback."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import pytest
import typer

from dpltm.cli_runtime import run_app, user_errors
from dpltm.errors import STOPPING, raise_if_stopping


def _signal_self(signum: signal.Signals) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode


class _SignalledWhileCollected:
    """An object that sends the signal from its finalizer: the handler's exception lands in `__del__`."""

    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum
        self.cycle = self  # freed by the garbage collector, as torch's import garbage is

    def __del__(self) -> None:
        _signal_self(self.signum)


def _lose_in_bare_except(signum: signal.Signals) -> None:
    try:
        _signal_self(signum)
    except BaseException:  # noqa: BLE001 - what some libraries do
        pass


def _lose_in_finalizer(signum: signal.Signals) -> None:
    _SignalledWhileCollected(signum)
    gc.collect()


def _app(lose: object, signum: signal.Signals, steps: list[int]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @user_errors
    def go() -> None:
        lose(signum)  # type: ignore[operator]
        _signal_self(signal.SIGTERM)  # a second signal while stopping is ignored
        for step in range(3):
            raise_if_stopping()  # what every training step and feature chunk calls
            steps.append(step)

    return app


@pytest.mark.parametrize("lose", [_lose_in_bare_except, _lose_in_finalizer], ids=["bare except", "finalizer"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_lost_signal_stops_the_next_step(lose: object, signum: signal.Signals, capfd: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["dpltm"])  # the one command runs
    monkeypatch.setattr("sys.unraisablehook", sys.__unraisablehook__)  # Python's, not pytest's: it prints
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    steps: list[int] = []
    with pytest.raises(SystemExit) as stopped:
        run_app(_app(lose, signum, steps))
    for s, handler in handlers.items():
        signal.signal(s, handler)
    err = capfd.readouterr().err
    assert stopped.value.code == 128 + signum and steps == []
    assert [line for line in err.splitlines() if line.startswith("dpltm:")][0].startswith(
        f"dpltm: interrupted ({signum.name})"), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not STOPPING  # the next command in this process starts afresh


def test_no_signal_no_stop() -> None:
    raise_if_stopping()  # nothing pending: the API's loops run on


def test_after_a_lost_signal_the_next_one_stops_a_command_that_takes_no_step(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Lost in a finalizer where no step follows (saving, accounting): a second signal is not ignored as one that
    came while the run unwinds, it stops the command, named after the first."""
    monkeypatch.setattr("sys.argv", ["dpltm"])
    monkeypatch.setattr("sys.unraisablehook", sys.__unraisablehook__)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    done: list[str] = []
    app = typer.Typer()

    @app.command()
    @user_errors
    def go() -> None:
        _lose_in_finalizer(signal.SIGINT)
        _signal_self(signal.SIGTERM)
        done.append("went on")

    with pytest.raises(SystemExit) as stopped:
        run_app(app)
    for s, handler in handlers.items():
        signal.signal(s, handler)
    err = capfd.readouterr().err
    assert stopped.value.code == 128 + signal.SIGINT and done == [], err
    assert "Traceback" not in err and "Exception ignored" not in err, err
