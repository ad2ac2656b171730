"""Where the stages talk to the user: progress and logs on stderr, reports on stdout.

Also what an interrupted command leaves behind (`on_interrupt_kept`): each stage says so once its
output is known, and the CLI prints it when SIGINT or SIGTERM stops the run.
"""

from __future__ import annotations

import sys
from typing import Any

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
            raise DpltmUserError(f"cannot write {self.what} to standard output: {exc.strerror or exc}") from None

    def flush(self) -> None:
        if sys.stdout is None:  # nothing was written (write refused it)
            return
        try:
            sys.stdout.flush()
        except OSError as exc:
            raise DpltmUserError(f"cannot write {self.what} to standard output: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno: what rich asks of the stream
        return getattr(sys.stdout, name)


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
