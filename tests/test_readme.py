"""The README's promises hold: its two set-up commands are the ones CI runs, its Data table covers every
dataset (the download errors point there), its API example runs, docs/api.md's blocks run in order, and
examples/own_model.py prints its JSON line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_DOC = ROOT / "docs" / "api.md"
RUN_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . && .venv/bin/dpltm run"
TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]' "
                "&& .venv/bin/pytest")


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next `## `)."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def run_blocks(blocks: list[str], name: str, namespace: dict[str, object]) -> None:
    for block in blocks:
        exec(compile(block, name, "exec"), namespace)  # noqa: S102 - the docs' own code


def test_readme_keeps_the_two_set_up_commands() -> None:
    """Exactly these two lines, each alone in a bash block: CI (`.ci/run`) and users copy them."""
    bash = re.findall(r"```bash\n(.*?)```", section(README.read_text(encoding="utf-8"), "Set-up: the two commands"),
                      flags=re.DOTALL)
    assert [block.strip() for block in bash] == [RUN_COMMAND, TEST_COMMAND]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet -c constraints.txt -e '.[test]'" in ci and ".venv/bin/pytest" in ci


def test_readme_data_table_names_every_dataset() -> None:
    """dpltm/data/download.py sends users to "the README's Data section" for the files to place by hand."""
    from dpltm.data.catalog import DATASET_ENTRIES

    data = section(README.read_text(encoding="utf-8"), "Data")
    rows = {row.split("|")[1]: row for row in data.splitlines() if row.startswith("| `")}
    for entry in DATASET_ENTRIES.values():
        row = next((r for cell, r in rows.items() if f"`{entry.name}`" in cell), None)
        assert row is not None, entry.name
        assert f"{entry.num_features} / {entry.num_classes}" in row, (entry.name, row)


def test_readme_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_blocks(section(README.read_text(encoding="utf-8"), "Python API"))
    assert len(blocks) == 1  # one short example; the rest is docs/api.md
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    run_blocks(blocks, "README.md", namespace)
    printed = capsys.readouterr().out.split()
    assert float(printed[0]) <= 1.0  # make_private's ε
    assert namespace["private"].epsilon <= 1.0  # type: ignore[attr-defined]


def test_api_doc_blocks_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """make_private, tickets on public data, DPCallback under a Lightning Trainer, accounting."""
    blocks = python_blocks(API_DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 4
    assert blocks[0] in README.read_text(encoding="utf-8")  # the README's example is the guide's first block
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "api_doc"}
    run_blocks(blocks, "docs/api.md", namespace)
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
