"""Shared fixtures: tiny synthetic datasets so training tests take seconds."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from click.testing import Result

from dpltm.data.types import DatasetSplits, LabeledTensors


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n`), the workers share the cores: each takes its share of torch's threads
    instead of every worker starting one per core (oversubscribed, each step slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run where CUDA is present and are skipped, saying why, everywhere else."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _run_folders_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI runs log into versioned folders (default ./logs): keep the suite's out of the checkout."""
    monkeypatch.setenv("DPLTM_LOG_DIR", str(tmp_path_factory.getbasetemp() / "run-logs"))
    # the front ends' feature cache (dpltm.feature_cache) too: never the user's ~/.cache
    monkeypatch.setenv("DPLTM_FEATURE_CACHE", str(tmp_path_factory.getbasetemp() / "feature-cache"))
    # and the public-ticket cache, one per test: a test's run never finds another test's tickets
    monkeypatch.setenv("DPLTM_TICKET_CACHE", str(tmp_path_factory.mktemp("ticket-cache")))


def make_blobs(n: int, features: int, classes: int, seed: int) -> LabeledTensors:
    """Linearly separable-ish Gaussian blobs: learnable in a few dozen steps."""
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(99)) * 2.0
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    features_ = centres[labels] + torch.randn(n, features, generator=g)
    return LabeledTensors(features_.float(), labels)


@pytest.fixture
def tiny_splits() -> DatasetSplits:
    return DatasetSplits(
        name="blobs", source_split="train",
        train=make_blobs(512, 20, 4, 0), val=make_blobs(128, 20, 4, 1),
        test=make_blobs(128, 20, 4, 2), num_features=20, num_classes=4, fingerprint="blobs-v1",
    )


@pytest.fixture(scope="session")
def cli() -> Callable[..., Result]:
    """`cli("train", "--dense", ...)` runs `dpltm.cli.app` in-process (typer's CliRunner) and returns
    its Result (.output, .stdout, .stderr, .exit_code). With ok=True (the default) it asserts exit
    code 0, showing the output if not; with ok=False the caller asserts what it expects. `env` sets
    environment variables for that one call. Session-scoped, so module-scoped fixtures can use it."""
    from typer.testing import CliRunner

    from dpltm.cli import app

    runner = CliRunner()

    def invoke(*args: str | Path, ok: bool = True, env: Mapping[str, str] | None = None) -> Result:
        result = runner.invoke(app, [str(arg) for arg in args], env=env)
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return invoke
