"""The `dpltm` console script: signal handlers first, then the CLI.

Importing the CLI (typer, rich; the commands import torch and Lightning later) takes about half a
second, during which Python's default SIGINT handler would print a KeyboardInterrupt traceback. This
module imports nothing heavy: it installs handlers that end the process with one line and exit
130/143 (nothing has been written yet), then hands over to `dpltm.cli.main`, which installs the
run's own handlers (unwind cleanly, clean temp files) for the rest and gives these back when the
command has finished. A command that finished ends without the interpreter's teardown
(`dpltm.cli_runtime.exit_without_teardown`). Only the interpreter's own start-up, before this module
runs (some 20 ms), is left to the default handlers.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from dpltm.errors import first_arrived, note_arrivals

_STAGE = ["while starting; nothing was written"]
"""What a signal handled here stopped: the start-up, or the exit of a command that has finished."""


def _stop(signum: int, frame: Any) -> None:
    signum = first_arrived(signum)
    os.write(2, f"dpltm: interrupted ({signal.Signals(signum).name}) {_STAGE[0]}\n".encode())
    os._exit(128 + signum)


def install_start_handlers() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    note_arrivals()


def main() -> None:
    install_start_handlers()
    from dpltm.cli import main as cli_main
    from dpltm.cli_runtime import exit_without_teardown

    try:
        cli_main()
    except SystemExit as exc:  # a failure exits the ordinary way, a run stopped by a signal at once
        if exc.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            exit_without_teardown(exc.code, stopped=True)
        raise
    _STAGE[0] = "while exiting; the command had finished"
    exit_without_teardown()
