"""Output streams that cannot spell ε or ∞ (PYTHONIOENCODING=ascii, a latin-1 pipe): the command still works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_narrow_stdout_gets_replacement_characters_not_a_traceback(encoding: str) -> None:
    env = {**os.environ, "PYTHONIOENCODING": encoding, "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-m", "dpltm.cli", "account", "--q", "0.01", "--steps", "10", "--sigma",
                           "1"], capture_output=True, env=env, timeout=120)
    stdout, stderr = done.stdout.decode(encoding), done.stderr.decode(encoding)
    assert done.returncode == 0, stderr
    assert "Traceback" not in stderr and "pld" in stdout and "0.37991" in stdout


ACCOUNT = ["account", "--dataset-size", "54000", "--batch-size", "400", "--epochs", "50", "--eps", "1"]


def _dpltm(args: list[str], cwd: Path, redirect: str) -> subprocess.CompletedProcess[str]:
    """`python -m dpltm.cli ARGS`, its streams redirected by `sh` as a user's shell would (`>&-` closes stdout)."""
    command = ["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m", "dpltm.cli", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tickets_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real ticket set (no training), for `inspect`."""
    from dpltm.checkpoint import save_atomic
    from tests.core.bodies import ticket_set

    path = tmp_path_factory.mktemp("tickets") / "t.pt"
    save_atomic(ticket_set().to_dict(), path, "tickets")
    return path


@pytest.mark.parametrize("command", ["account", "inspect", "--version"])
def test_a_closed_stdout_fails_the_command_in_one_line(command: str, tickets_file: Path) -> None:
    """Started with stdout closed (`>&-`), Python has no sys.stdout, and the report went nowhere with exit 0: now
    refused before any work (a training run no longer runs to its end first)."""
    args = {"account": ACCOUNT, "inspect": ["inspect", str(tickets_file)], "--version": ["--version"]}[command]
    done = _dpltm(args, tickets_file.parent, ">&-")
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("dpltm: error: standard output is closed: dpltm prints its reports there (discard them "
                           "with > /dev/null)\n")


@pytest.mark.parametrize("args", [ACCOUNT, [*ACCOUNT, "--json"], ["--help"]])
def test_a_reader_that_leaves_ends_the_command_quietly(args: list[str], tmp_path: Path) -> None:
    """`dpltm inspect f.pt | head -1`: a broken pipe ends the command as a Unix filter ends, exit 1 and no message
    (it printed 'cannot write the report to standard output: Broken pipe')."""
    # the reader is gone long before the interpreter has started, so the first write meets a closed pipe
    done = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | (exit 0)', "bash", sys.executable, "-m",
                           "dpltm.cli", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1) and done.stderr == "", done.stderr


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full")
def test_help_to_a_full_stdout_is_one_line(tmp_path: Path) -> None:
    done = _dpltm(["--help"], tmp_path, "> /dev/full")
    assert done.returncode == 2 and done.stderr == "dpltm: error: a write failed: No space left on device\n"


def test_with_both_streams_closed_the_exit_code_still_says_it_failed(tmp_path: Path) -> None:
    done = _dpltm(ACCOUNT, tmp_path, ">&- 2>&-")
    assert done.returncode == 2 and done.stdout == done.stderr == ""


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full")
@pytest.mark.parametrize(("flags", "what"), [([], "the report"), (["--json"], "the --json report")])
def test_a_full_stdout_is_one_line_naming_standard_output_not_a_file(flags: list[str], what: str,
                                                                     tmp_path: Path) -> None:
    """`> /dev/full`: the write fails with ENOSPC and no file name; the line said "cannot write a file"."""
    done = _dpltm([*ACCOUNT, *flags], tmp_path, "> /dev/full")
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"dpltm: error: cannot write {what} to standard output: No space left on device\n"
