"""A finished command ends without the interpreter's teardown (dpltm.entry.exit_without_teardown), and
loses nothing by it: its output is whole, `atexit` handlers run, a thread still at work is waited for, and
a failure exits the ordinary way with its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ACCOUNT = ["account", "--dataset-size", "54000", "--batch-size", "400", "--epochs", "5", "--eps", "1", "--json"]


def console(prelude: str, argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The console script (`dpltm.entry:main`) in a fresh interpreter, after `prelude`."""
    code = (f"import atexit, os, sys, threading, time\n{prelude}\n"
            f"sys.argv = ['dpltm', *{argv!r}]\nfrom dpltm.entry import main\nmain()\n")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_finished_command_prints_everything_and_runs_the_atexit_handlers(tmp_path: Path) -> None:
    result = console("atexit.register(lambda: sys.stderr.write('atexit ran\\n'))\n"
                     "sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1 << 20, closefd=False)",  # a big buffer
                     ACCOUNT, tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["steps"] == 5 * 54000 // 400 and {row["accountant"] for row in report["rows"]} >= {"pld"}
    assert result.stderr.strip().splitlines()[-1] == "atexit ran"


def test_a_thread_still_at_work_is_waited_for(tmp_path: Path) -> None:
    """A non-daemon thread alive at the end (a plug-in's writer, say) finishes: the ordinary exit joins it."""
    marker = tmp_path / "written"
    result = console(f"threading.Thread(target=lambda: (time.sleep(2), open({str(marker)!r}, 'w').write('x'))).start()",
                     ACCOUNT, tmp_path)
    assert result.returncode == 0, result.stderr
    assert marker.read_text() == "x"


def test_a_failure_keeps_its_code_and_one_line(tmp_path: Path) -> None:
    result = console("", ["account", "--dataset-size", "0", "--eps", "1"], tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("dpltm: error:")


def test_the_ordinary_exit_on_request_gives_the_same_output(tmp_path: Path) -> None:
    fast = console("", ACCOUNT, tmp_path)
    ordinary = console("", ACCOUNT, tmp_path, DPLTM_FULL_TEARDOWN="1")
    assert fast.returncode == ordinary.returncode == 0
    assert json.loads(fast.stdout) == json.loads(ordinary.stdout)


def test_a_report_with_stdout_closed_is_one_line(tmp_path: Path) -> None:
    """Started with stdout closed (`>&-`), Python gives the process no stdout stream at all."""
    result = console("sys.stdout = None", ACCOUNT, tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("dpltm: error: standard output is closed: dpltm prints its reports there (discard them "
                             "with > /dev/null)\n")
