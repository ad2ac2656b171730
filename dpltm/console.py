"""Where the stages talk to the user: progress and logs on stderr, reports on stdout.

Also what an interrupted command leaves behind (`on_interrupt_kept`): each stage says so once its
output is known, and the CLI prints it when SIGINT or SIGTERM stops the run.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, NoReturn

from rich.console import Console

from dpltm.errors import DpltmUserError


class ReportStream:
    """Standard output as the reports reach it: `sys.stdout` as it is at each write (tests and progress bars swap
    it), its failures one-line user errors. Started with stdout closed (`>&-`), Python has no `sys.stdout` at all and
    rich would print to nowhere, the command ending 0; a full device (`> /dev/full`) or a closed pipe fails the
    write with an OSError that names no file. Every report on stdout (`out_console`, `--json`) is written here."""

    def __init__(self, what: str = "the report") -> None:
        self.what = what

    def write(self, text: str) -> int:
        stream = sys.stdout
        if stream is None:
            raise DpltmUserError(f"standard output is closed: nowhere to print {self.what}")
        try:
            return stream.write(text)
        except OSError as exc:
            self._failed(exc)

    def flush(self) -> None:
        if sys.stdout is None:  # nothing was written (write refused it)
            return
        try:
            sys.stdout.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> NoReturn:
        if exc.errno == errno.EPIPE:
            quiet_broken_pipe()
        kept = kept_on_interrupt()
        raise DpltmUserError(f"cannot write {self.what} to standard output: {exc.strerror or exc}"
                             + ("" if kept == "nothing was written" else f" ({kept})")) from None

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno: what rich asks of the stream
        return getattr(sys.stdout, name)


def quiet_broken_pipe() -> NoReturn:
    """The reader of standard output left (`dpltm inspect f.pt | head -1`): end as quietly as a Unix filter, exit 1.
    Standard output is pointed at /dev/null first, so the exit's own flush does not fail again (Python's advice,
    docs "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    raise SystemExit(1)


err_console = Console(stderr=True)
out_console = Console(file=ReportStream())  # type: ignore[arg-type]  # a stream by duck typing, as rich reads it

_kept_on_interrupt = ["nothing was written"]
_kept_by_earlier_stages: list[str] = []


def on_interrupt_kept(note: str) -> None:
    """What the running stage leaves if stopped now."""
    _kept_on_interrupt[0] = note


def kept_by_earlier_stage(note: str) -> None:
    """A file an earlier stage of one command (`dpltm run`) finished: said before the running stage's note."""
    _kept_by_earlier_stages.append(note)


def forget_kept() -> None:
    """A new command: nothing kept yet."""
    _kept_on_interrupt[0] = "nothing was written"
    _kept_by_earlier_stages.clear()


def kept_on_interrupt() -> str:
    return "; ".join([*_kept_by_earlier_stages, _kept_on_interrupt[0]])


def warn_large_delta(delta: float, records: int) -> None:
    """The CLI's warning for δ > 1/N (the API's is dpltm.api_checks.warn_if_delta_above_one_over_n)."""
    if delta > 1.0 / records:
        err_console.print(f"warning: δ = {delta:g} is above 1/N = {1.0 / records:.3g}: an (ε, δ) guarantee with "
                          "δ > 1/N allows releasing a record outright; the usual choice is δ ≪ 1/N")
