"""The exception types the CLI turns into one line.

The CLI turns a `DpltmUserError` into a single line on stderr and a non-zero exit, with no
traceback; anything else is a bug and keeps its traceback. `Interrupted` is raised by the CLI's
signal handlers (SIGINT, SIGTERM) so that a stopped run unwinds like an error: temp files are
removed, nothing half-written is published, and the user is told what was kept.
"""

import signal


class DpltmUserError(Exception):
    """A mistake the user can fix: bad option, missing file, foreign checkpoint, ..."""


class Interrupted(BaseException):
    """A run stopped by a signal. A BaseException, so that no `except Exception` swallows it
    (Lightning's trainer re-raises it after its teardown)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum
