"""How the `dpltm` command line behaves as a program: one line per user error, signals, JSON out.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback); SIGINT and
SIGTERM unwind a run as an exception (temp files are cleaned on the way out) and exit 128 +
signum; `--json` reports go to stdout. The commands themselves are in dpltm.cli.
"""

from __future__ import annotations

import atexit
import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from dpltm.console import ReportStream, forget_kept, kept_on_interrupt, quiet_broken_pipe
from dpltm.errors import (
    STOPPING,
    USER_ERRNOS,
    DpltmUserError,
    Interrupted,
    drop_lost_interrupts,
    first_arrived,
    interrupt_was_lost,
    one_line,
    os_error_message,
)
from dpltm.launch_env import check_rank_environment
from dpltm.paths import forget_inputs, names_stdout

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn user mistakes into one clear line and exit 2; a signal into one line and 128 + signum."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        forget_kept()
        forget_inputs()
        try:
            check_rank_environment()  # before Lightning's import parses them
            return func(*args, **kwargs)
        except DpltmUserError as exc:
            typer.echo(f"dpltm: error: {one_line(str(exc))}", err=True)
            raise typer.Exit(2) from None
        except OSError as exc:  # a full disk, a name too long: the user's to fix (written files are cleaned)
            if exc.errno not in USER_ERRNOS:
                raise
            typer.echo(f"dpltm: error: {one_line(os_error_message(exc))}", err=True)
            raise typer.Exit(2) from None
        except (KeyboardInterrupt, Interrupted) as exc:
            raise typer.Exit(_say_interrupted(exc)) from None

    return wrapper  # type: ignore[return-value]


def _say_interrupted(exc: BaseException) -> int:
    """The one line for a run stopped by a signal; its exit code, 128 + signum."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    # on a line of its own: a progress bar may have left the cursor at the end of its line
    typer.echo(f"\ndpltm: interrupted ({signal.Signals(signum).name}); {kept_on_interrupt()}", err=True)
    return 128 + signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Signal handler: unwind the run as an exception (temp files are cleaned on the way out), named
    after the signal that came first. Further signals are ignored while it unwinds, so the clean-up
    itself is not cut short; by this handler staying in place and returning, not by SIG_IGN: a second
    signal that arrived with the first but is handled after it would find SIG_IGN and be reported by
    Python as "Signal 15 ignored due to race condition", with a traceback."""
    if STOPPING and not interrupt_was_lost():
        return
    if not STOPPING:
        STOPPING.append(first_arrived(signum))
    raise Interrupted(STOPPING[0])


def emit_json(report: dict[str, Any]) -> None:
    """A report as one line of strict JSON (no NaN) on stdout."""
    from dpltm.strict_json import dumps

    stream = ReportStream("the --json report")  # a closed or full stdout: one line, not silence or a traceback
    stream.write(dumps(report) + "\n")
    stream.flush()


def folder_named_as_output(argv: list[str]) -> str | None:
    """The error for `--out dir/`: Click's path type drops the trailing separator, so the folder would be taken
    for the name of the file to write (and a file of that name made); and for `--out -` (`names_stdout`), refused
    here for every command before any other check of its output."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    for _, value in _values_given(["--out"], args):
        if not value.strip():
            return "--out takes the name of the file to write, got an empty name"
        if (problem := names_stdout(value)) is not None:
            return problem
        if value.endswith(("/", os.sep)):
            command = next((a for a in argv if not a.startswith("-")), "")
            example = OUTPUT_EXAMPLES.get(command, "model.pt")
            return f"--out {value} names a folder: give the file to write in it (e.g. --out {value}{example})"
    return None


def _command_and_args(app: typer.Typer, argv: list[str]) -> tuple[Any, list[str]]:
    """The (sub)command `argv` names and the arguments after its name, up to a `--`."""
    command = typer.main.get_command(app)  # typer's own (vendored) Click classes: read by duck typing
    args = list(argv)
    while isinstance(getattr(command, "commands", None), dict) and args:
        sub = command.commands.get(args[0])  # type: ignore[attr-defined]
        if sub is None:
            return None, []
        command, args = sub, args[1:]
    if "--" in args:
        args = args[: args.index("--")]
    return command, args


def _values_given(names: list[str], args: list[str]) -> list[tuple[str, str]]:
    """(name, value) for each use of an option called any of `names` in `args` (`--x v` or `--x=v`)."""
    given = []
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args):
                given.append((name, args[index + 1]))
            elif arg.startswith(name + "="):
                given.append((name, arg[len(name) + 1:]))
    return given


PRIVACY_TERMS = frozenset({"eps", "eps1", "max_eps", "delta", "sigma", "clip", "neighboring", "accountant",
                           "noise"})
"""Parameters that state a run's privacy guarantee: given twice with different values, refused even under one name."""


def options_at_odds(app: typer.Typer, argv: list[str]) -> str | None:
    """The error for an option given an empty value (`--data-dir ''` would be the current folder, `--device ''`
    the default device), or one option given twice with different values under two of its names (`--eps 1 --eps2
    2`, `--neighbouring replace-one --neighboring add-remove`), or under one name where it states the guarantee
    (`--eps 0.5 --eps 5`: `PRIVACY_TERMS`): Click keeps the last silently, which may be the weaker guarantee. Other
    options repeated under one name keep Click's last-one-wins (an alias's default, then the user's override)."""
    command, args = _command_and_args(app, argv)
    for param in getattr(command, "params", []):
        names = [name for name in getattr(param, "opts", []) if name.startswith("--")]
        if not names or getattr(param, "is_flag", False) or getattr(param, "param_type_name", "") != "option":
            continue
        given = _values_given(names, args)
        for name, value in given:
            if not value.strip():
                return f"{name} got an empty value"
        if len({value for _, value in given}) > 1:
            spellings = list(dict.fromkeys(name for name, _ in given))
            if len(spellings) == 1 and getattr(param, "name", None) not in PRIVACY_TERMS:
                continue
            shown = " and ".join(f"{name} {value}" for name, value in given)
            if len(spellings) > 1:
                return (f"{' and '.join(spellings)} are one option, given twice with different values ({shown}): "
                        "give it once")
            return f"{spellings[0]} was given twice with different values ({shown}): give it once"
    if command is not None and any(not arg.strip() for arg in args):  # an option's empty value was caught above
        return "an argument is empty: a path or name was expected"
    return None


OUTPUT_EXAMPLES = {"generate": "tickets.pt", "select": "winner.pt", "export": "model.safetensors",
                   "predict": "predictions.csv", "plot": "curves.png"}
"""A file name of the kind each command writes, for the `--out dir/` hint (else a model file)."""


def tolerate_narrow_streams() -> None:
    """Streams whose encoding cannot spell ε or ∞ (PYTHONIOENCODING=ascii, a latin-1 pipe) write "?" in their
    place instead of ending the command with a UnicodeEncodeError after its work was done."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            "ε∞σθ≤".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors="replace")


def run_app(app: typer.Typer) -> None:
    """Run `app` as the entry point: the parser's own usage errors become one line too; SIGINT and SIGTERM stop a
    run cleanly with one line and exit 130 / 143."""
    from typer.exceptions import Abort, TyperException

    tolerate_narrow_streams()
    problem = ("standard output is closed: dpltm prints its reports there (discard them with > /dev/null)"
               if sys.stdout is None else None)  # said before any work, not after it
    problem = problem or folder_named_as_output(sys.argv[1:]) or options_at_odds(app, sys.argv[1:])
    if problem is not None:
        typer.echo(f"dpltm: error: {problem}", err=True)
        raise SystemExit(2)
    STOPPING.clear()
    interrupt_was_lost()
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook
    sys.unraisablehook = lambda report: None if drop_lost_interrupts(report) else unraisable(report)
    try:
        code = app(standalone_mode=False)  # returns typer.Exit's code instead of exiting
    except (KeyboardInterrupt, Interrupted) as exc:  # outside the command: while parsing, or after it returned
        raise SystemExit(_say_interrupted(exc)) from None
    except Abort:
        typer.echo("dpltm: interrupted", err=True)
        raise SystemExit(130) from None
    except OSError as exc:  # what no command caught: `--help` or `--version` printed to a full or closed pipe
        if exc.errno == errno.EPIPE:
            quiet_broken_pipe()
        if exc.errno not in USER_ERRNOS:
            raise
        typer.echo(f"dpltm: error: {os_error_message(exc)}", err=True)
        raise SystemExit(2) from None
    except TyperException as exc:  # usage errors: bad option, bad value, missing argument
        message = " ".join(exc.format_message().split()).replace("Value error, ", "")  # typer's enum wording
        if not message:  # `dpltm` alone: the help was printed, there is no error to add
            raise SystemExit(0) from None
        typer.echo(f"dpltm: error: {one_line(message)}", err=True)
        raise SystemExit(max(int(getattr(exc, "exit_code", 2)), 2)) from None
    finally:  # main() may run inside another program (tests): leave its handlers as they were,
        # except after a signal, when the process is about to exit 128 + signum: a second Ctrl-C
        # must not kill it with the default handler on the way out (signal.signal runs any signal
        # pending first, through _raise_interrupted, which ignores it)
        stopping = bool(STOPPING)
        try:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_IGN if stopping else handler)
        finally:  # the process exits now, or (tests) goes on to other work
            sys.unraisablehook = unraisable
            STOPPING.clear()
            interrupt_was_lost()
    if isinstance(code, int) and code != 0:
        raise SystemExit(code)


def exit_without_teardown(code: int = 0, stopped: bool = False) -> None:
    """End a command that has finished, or a run `stopped` by a signal, skipping the interpreter's teardown.

    Why: once torch and Lightning are imported, Python's finalisation (tearing down some 8000 modules
    and their objects) takes 0.7–1.9 s, a tenth of a warm `dpltm run` on a GPU. At this point every
    file a command writes is on disk and closed (atomic writes), so only the teardown is skipped: the
    `atexit` handlers still run (logging's flush, temporary folders, coverage), both streams are flushed,
    and a command that left another non-daemon thread running, or whose output cannot be flushed (a
    closed pipe), ends the ordinary way. A stopped run waits for no thread: their work (the ε of epochs
    ahead, say) was for the run that stopped, and the ordinary exit would make a Ctrl-C wait for all of
    it. `DPLTM_FULL_TEARDOWN=1` always takes the ordinary way.
    """
    if os.environ.get("DPLTM_FULL_TEARDOWN", "") not in ("", "0"):
        return
    if not stopped and any(thread is not threading.main_thread() and thread.is_alive() and not thread.daemon
                           for thread in threading.enumerate()):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # the ordinary exit reports it as Python does
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        code = code or 1
    os._exit(code)
