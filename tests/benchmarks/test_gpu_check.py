"""benchmarks/gpu/check.sh runs only on a lent GPU machine, rarely and within a short lease: here, it parses and
every flag it passes to dpltm or to a benchmark is one that command takes, so a renamed flag fails now, not there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks" / "gpu"


def commands() -> list[list[str]]:
    """The check's python3 commands, continuation lines joined, each as its words after `python3`."""
    text = (SCRIPTS / "check.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    return [line.split("python3", 1)[1].split() for line in text.splitlines()
            if line.startswith("step ") and "python3" in line]


@pytest.mark.parametrize("script", ["check.sh", "prepare.sh"])
def test_the_scripts_parse(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True).returncode == 0


def test_every_flag_the_check_passes_is_taken_by_its_command() -> None:
    checked = 0
    for words in commands():
        if words[:2] == ["-m", "dpltm.cli"]:
            program, rest = [sys.executable, "-m", "dpltm.cli", words[2]], words[3:]
        elif words[0].startswith("benchmarks/"):
            program, rest = [sys.executable, str(ROOT / words[0])], words[1:]
        else:
            continue
        help_text = subprocess.run([*program, "--help"], capture_output=True, text=True, cwd=ROOT,
                                   env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, timeout=120).stdout
        for flag in (w for w in rest if w.startswith("--")):
            as_option = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"  # the whole flag, not a prefix of another
            assert re.search(as_option, help_text), f"{' '.join(words[:3])}: {flag} is not an option"
            checked += 1
    assert checked >= 15


def test_a_step_name_the_check_does_not_have_is_refused_before_anything_runs() -> None:
    run = subprocess.run(["bash", str(SCRIPTS / "check.sh"), "run_cold"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 104 and "no step named 'run_cold'" in run.stderr  # not a silent "0 failed steps"
