"""An installed wheel, not the checkout: its configs ship as package data and are the ones read.

A wheel once had no YAML at all (the configs sat outside the package), and `digits` then
trained with the global defaults, silently. Built without network (no build isolation).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end, in fresh processes


REPO = Path(__file__).resolve().parent.parent
OFFLINE = ("--no-index", "--disable-pip-version-check")
"""Tests never need the network: where none is reachable, pip's index and version checks hang."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "wheel", *OFFLINE, "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(out), str(REPO)], check=True, timeout=300,
                   env={**os.environ, "TMPDIR": str(build)})
    (found,) = out.glob("dpltm-*.whl")
    return found


def test_wheel_ships_every_config(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {"dpltm/" + p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml")}
    assert shipped and shipped <= names


def test_installed_wheel_reads_its_dataset_config(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", *OFFLINE, "--no-deps", "--quiet", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    probe = ("import dpltm, dpltm.config as c; "
             "cfg = c.resolve_generate_config({'data': {'dataset': 'digits'}}, None); "
             "print(dpltm.__file__); print(cfg.generate.batch_size, cfg.generate.iterations)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(site), os.environ.get("PYTHONPATH")]))},
                            timeout=120, check=True)
    where, values = result.stdout.splitlines()
    assert Path(where).is_relative_to(site)  # the wheel's copy, not the checkout
    assert values == "100 2000"  # configs/datasets/digits.yaml, not the global 400 / 5000


def test_installing_the_wheel_keeps_the_torch_already_installed(wheel: Path, tmp_path: Path) -> None:
    """Ranges, not pins: pip resolves the wheel against this environment's torch and installs
    nothing but dpltm itself (offline, so it could not pull another torch if it wanted to)."""
    import json

    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", *OFFLINE, "--dry-run", "--quiet", "--report", str(report),
                    str(wheel)], check=True, timeout=300)
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["dpltm"]
