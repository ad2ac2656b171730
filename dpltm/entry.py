"""The `dpltm` console script: signal handlers first, then the CLI.

Importing the CLI (typer, rich; the commands import torch and Lightning later) takes about half a
second, during which Python's default SIGINT handler would print a KeyboardInterrupt traceback. This
module imports nothing heavy: it installs handlers that end the process with one line and exit
130/143 (nothing has been written yet), then hands over to `dpltm.cli.main`, which installs the
run's own handlers (unwind cleanly, clean temp files) for the rest. A command that finished ends
without the interpreter's teardown (`dpltm.cli_runtime.exit_without_teardown`).
"""

from __future__ import annotations

import os
import signal
from typing import Any


def _while_starting(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"dpltm: interrupted ({name}) while starting; nothing was written\n".encode())
    os._exit(128 + signum)


def install_start_handlers() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _while_starting)


def main() -> None:
    install_start_handlers()
    from dpltm.cli import main as cli_main

    cli_main()  # a failure raises SystemExit and exits the ordinary way
    from dpltm.cli_runtime import exit_without_teardown

    exit_without_teardown()
