"""The README's "Python API" section runs as written, and examples/own_model.py prints its JSON line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_api_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_readme_python_api_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_api_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out.split()
    assert float(printed[0]) <= 1.0  # make_private's ε
    assert namespace["private"].epsilon <= 1.0 and namespace["dp"].epsilon <= 1.0  # type: ignore[attr-defined]


@pytest.mark.slow
def test_own_model_example_prints_epsilon_and_accuracy() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "own_model.py"), "--epochs", "3"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0.9 < report["epsilon"] <= 1.0 and report["test_accuracy"] > 0.6 and report["density"] < 1.0
