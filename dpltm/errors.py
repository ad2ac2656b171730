"""The exception types the CLI turns into one line.

The CLI turns a `DpltmUserError` into a single line on stderr and a non-zero exit, with no
traceback; anything else is a bug and keeps its traceback. `Interrupted` is raised by the CLI's
signal handlers (SIGINT, SIGTERM) so that a stopped run unwinds like an error: temp files are
removed, nothing half-written is published, and the user is told what was kept.
"""

import errno
import os
import signal

#: The longest error message printed: a value quoted in a message (a YAML alias bomb expands to
#: megabytes) is cut here, so the error stays one readable line.
MAX_MESSAGE_CHARS = 1000


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` as one printable line: control characters (a newline in a path, an escape
    sequence) shown escaped, and beyond `limit` characters its middle cut with a note. The end stays: a
    message names what failed first (a path, a value) and why last, and the why must survive a long name."""
    text = "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in message)
    if len(text) > limit:
        tail = limit // 4
        text = f"{text[:limit - tail]}… ({len(text) - limit} more characters) …{text[-tail:]}"
    return text


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


STOPPING: list[int] = []
"""The signal a CLI run is stopping for (set by its handler, `dpltm.cli_runtime`); empty otherwise."""


def raise_if_stopping() -> None:
    """Raise the run's `Interrupted` again at a step or a chunk of work if its signal was already handled.

    Why: a signal handler's exception surfaces at whatever bytecode runs when the signal lands. If that is a
    finalizer (`__del__`, a weakref callback run by the garbage collector while torch is imported), Python
    reports it as unraisable and carries on; a library's bare `except:` swallows it the same way. The handler
    has marked the run as stopping and ignores further signals, so without this check the run would go on
    as if no signal had come. Nothing runs a step while the run unwinds, so a set `STOPPING` here means the
    first exception was lost."""
    if STOPPING:
        _LOST.clear()  # raised again here: the run unwinds now
        raise Interrupted(STOPPING[0])


_LOST: list[bool] = []
"""Set when a signal's `Interrupted` was dropped as unraisable, until it is raised again."""


def drop_lost_interrupts(unraisable: object) -> bool:
    """Whether an unraisable exception (`sys.unraisablehook`'s argument) is a signal's `Interrupted`: it is not
    reported (no traceback for a Ctrl-C); the next `raise_if_stopping` raises it where it can unwind the run, and
    so does the next signal (`interrupt_was_lost`), where no step follows."""
    if isinstance(getattr(unraisable, "exc_value", None), Interrupted):
        _LOST.append(True)
        return True
    return False


def interrupt_was_lost() -> bool:
    """Whether the stopping signal's `Interrupted` was dropped as unraisable and not raised again since."""
    lost = bool(_LOST)
    _LOST.clear()
    return lost


_ARRIVALS: list[int] = []
"""The read end of the pipe Python writes each arriving signal's number to (`note_arrivals`)."""


def note_arrivals() -> None:
    """Have Python write each arriving signal's number to a pipe (`signal.set_wakeup_fd`), unless the
    process has its own wake-up fd. Two signals that land while the main thread is in one C call (an
    import, a tensor operation) have their handlers run in signal-number order, SIGINT before SIGTERM
    whichever came first; the pipe keeps the order they came in (`first_arrived`)."""
    if _ARRIVALS:
        return
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous == -1:
        _ARRIVALS.append(read)
        return
    signal.set_wakeup_fd(previous)  # not ours to replace: put it back
    os.close(read)
    os.close(write)


def first_arrived(signum: int) -> int:
    """The first SIGINT or SIGTERM in the pipe (`note_arrivals`), else `signum`; the pipe is emptied."""
    try:
        arrived = os.read(_ARRIVALS[0], 4096) if _ARRIVALS else b""
    except BlockingIOError:
        arrived = b""
    return next((number for number in arrived if number in (signal.SIGINT, signal.SIGTERM)), signum)


#: OS errors that are the user's to fix (a full disk, a quota, a read-only file system, a name
#: too long, a file or folder the user may not write: permissions, an immutable file): the CLI
#: reports them in one line, naming the file, instead of a traceback.
USER_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG, errno.EACCES,
                         errno.EPERM})


def os_error_behind(exc: BaseException) -> OSError | None:
    """The OS error behind a failed write: `exc` itself, or the one torch.save's zip writer was handling when
    it raised its RuntimeError ("unexpected pos"); None if there is none."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return cause


def os_error_message(exc: OSError) -> str:
    """`cannot write FILE: No space left on device`; the file as the OS error names it. An error that names none
    (a write to a stream, not a path) is not said to be a file's."""
    if exc.filename is None:
        return f"a write failed: {exc.strerror or exc}"
    return f"cannot write {exc.filename}: {exc.strerror or exc}"
