"""Output streams that cannot spell ε or ∞ (PYTHONIOENCODING=ascii, a latin-1 pipe): the command still works."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_narrow_stdout_gets_replacement_characters_not_a_traceback(encoding: str) -> None:
    env = {**os.environ, "PYTHONIOENCODING": encoding, "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-m", "dpltm.cli", "account", "--q", "0.01", "--steps", "10", "--sigma",
                           "1"], capture_output=True, env=env, timeout=120)
    stdout, stderr = done.stdout.decode(encoding), done.stderr.decode(encoding)
    assert done.returncode == 0, stderr
    assert "Traceback" not in stderr and "pld" in stdout and "0.37991" in stdout
