"""Where the stages talk to the user: progress and logs on stderr, reports on stdout.

Also what an interrupted command leaves behind (`on_interrupt_kept`): each stage says so once its
output is known, and the CLI prints it when SIGINT or SIGTERM stops the run.
"""

from __future__ import annotations

from rich.console import Console

err_console = Console(stderr=True)
out_console = Console()

_kept_on_interrupt = ["nothing was written"]


def on_interrupt_kept(note: str) -> None:
    _kept_on_interrupt[0] = note


def kept_on_interrupt() -> str:
    return _kept_on_interrupt[0]
