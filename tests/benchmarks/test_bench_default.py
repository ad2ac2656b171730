"""benchmarks/bench_default.py pairs each README job with the dense baseline of the recipe it took, on seeds the grid
never used, and says whether the mean paired difference is ≥ 0 in every cell (the runs themselves are stubbed)."""

from __future__ import annotations

import sys

import bench_default
import pytest


def test_pairs_runs_by_seed_and_averages_the_paired_differences(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[list[str]] = []
    accuracy = {("run", "101"): 0.97, ("train", "101"): 0.975, ("run", "102"): 0.98, ("train", "102"): 0.97}

    def fake(args: list[str], env: dict[str, str]) -> tuple[dict[str, object], float]:
        calls.append(args)
        if args[0] == "inspect":
            return {"architecture": {"name": "scatter-linear"}}, 0.1
        seed = args[args.index("--seed") + 1]
        return {"test_accuracy": accuracy[(args[0], seed)], "epsilon": 1.0}, 1.0

    monkeypatch.setattr(bench_default, "dpltm", fake)
    monkeypatch.setattr(sys, "argv", ["bench_default.py", "--datasets", "mnist", "--eps", "1", "--seeds", "101", "102"])
    bench_default.main()
    dense_runs = [c for c in calls if c[0] == "train"]
    assert all(c[c.index("--arch") + 1] == "scatter-linear" and c[c.index("--recipe") + 1] == "scatter"
               for c in dense_runs) and len(dense_runs) == 2
    out = capsys.readouterr().out
    assert "+0.0025 ±" in out  # the mean of −0.005 and +0.010
    assert "target (mean paired difference ≥ 0 in every cell): met (1 of 1 cells)" in out


def test_the_grids_seeds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_default.py", "--seeds", "1", "101"])
    with pytest.raises(SystemExit, match="were the grid's"):
        bench_default.main()
