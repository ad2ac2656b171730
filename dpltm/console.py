"""Where the stages talk to the user: progress and logs on stderr, reports on stdout.

Also what an interrupted command leaves behind (`on_interrupt_kept`): each stage says so once its
output is known, and the CLI prints it when SIGINT or SIGTERM stops the run.
"""

from __future__ import annotations

from rich.console import Console

err_console = Console(stderr=True)
out_console = Console()

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
