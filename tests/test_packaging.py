"""Packaging: ranges users can live with, a constraints file that pins this machine's torch within
them, every imported third-party package declared, and the CLI's -h / --version."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import dpltm

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
IMPORT_TO_DISTRIBUTION = {"yaml": "pyyaml", "dp_accounting": "dp-accounting", "attr": "attrs"}


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}


def test_dependencies_are_ranges_and_the_constraints_pin_torch_within_them() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {**{Requirement(r).name.lower(): Requirement(r) for group in project["optional-dependencies"].values()
                   for r in group}, **requirements()}
    assert "torchvision" not in requirements()  # an extra (download): it pins torch exactly
    for name in ("torch", "torchvision"):
        assert not any(spec.operator == "==" for spec in declared[name].specifier), name
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} == {"torch", "torchvision"}
    for pin in pins:
        version = next(iter(pin.specifier)).version
        assert declared[pin.name].specifier.contains(version), (pin.name, version)
    for text in ((ROOT / ".ci" / "run").read_text(), (ROOT / "README.md").read_text()):
        assert "-c constraints.txt" in text


def test_every_third_party_import_is_declared() -> None:
    """…as a dependency, or in an extra for the lazily imported ones (matplotlib: `plots`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {Requirement(r).name.lower() for group in project["optional-dependencies"].values() for r in group}
    declared = set(requirements()) | extras
    missing = set()
    for path in (ROOT / "dpltm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                top = name.split(".")[0]
                if top == "dpltm" or top in sys.stdlib_module_names:
                    continue
                if IMPORT_TO_DISTRIBUTION.get(top, top).lower() not in declared:
                    missing.add(top)
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_version_and_short_help(cli) -> None:
    version = cli("--version", ok=False)
    assert version.exit_code == 0 and version.output.strip() == f"dpltm {dpltm.__version__}"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == dpltm.__version__
    for args in (["-h"], ["train", "-h"], ["generate", "-h"]):
        result = cli(*args, ok=False)
        assert result.exit_code == 0 and "Usage" in result.output, args


def test_every_package_is_listed_and_configs_install_as_package_data() -> None:
    """pyproject lists the packages by hand (configs/ maps to `dpltm.configs`): a new subpackage
    must be added there, or an installed wheel would lack it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dpltm").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"dpltm.configs"}
    assert setuptools["package-dir"] == {"dpltm.configs": "configs"}
    from importlib import resources

    shipped = resources.files("dpltm.configs")
    assert (shipped / "defaults.yaml").is_file() and (shipped / "recipes" / "tuned.yaml").is_file()
