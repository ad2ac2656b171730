"""The models benchmark builds each model, runs each step kind and reports time and peak memory side by side (it runs
unattended in the GPU check's short lease)."""

from __future__ import annotations

import re

import pytest
import torch
from bench_models import MODELS, main, measure, random_masks


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_runs_a_dp_step_through_dpltm(name: str) -> None:
    result = measure(name, "dpltm masked", 2, torch.device("cpu"), warmup=0, steps=1)
    assert result["ms"] > 0 and result["peak_mb"] >= 0


def test_random_masks_keep_about_the_density_of_every_prunable_weight() -> None:
    build, _ = MODELS["embedding"]
    masks = random_masks(build(), 0.3, torch.Generator().manual_seed(0))
    assert masks and all(0.25 < float(m.float().mean()) < 0.35 for m in masks.values())


def test_the_table_sets_dpltm_beside_opacus_ghost(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--models", "embedding", "--methods", "non-private,dpltm,opacus ghost", "--batch-size", "4", "--steps", "1",
          "--warmup", "0", "--rounds", "1"])
    out = capsys.readouterr().out
    rows = re.findall(r"^embedding\s+(non-private|dpltm|opacus ghost)\s+([0-9.]+)\s+([0-9.]+)", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["non-private", "dpltm", "opacus ghost"], out
    assert re.search(r"dpltm / ghost\s+time [0-9.]+x, peak memory [0-9.]+x", out), out
