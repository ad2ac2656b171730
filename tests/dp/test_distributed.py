"""DP-SGD over two processes (gloo on the CPU): the same mechanism, the same ε, as on one device.

* sharded Poisson sampling includes each record with probability q (the union of the ranks'
  batches is one Poisson batch);
* a two-rank step's all-reduced clipped sum equals one process's clipped sum over the union of
  the ranks' batches, and the noise is one draw (rank 0's): ĝ is identical on both ranks and equal
  to the one-process ĝ with rank 0's noise seed;
* `dpltm train --devices 2` (Lightning DDP, two gloo processes, the real CLI) reports the ε of the
  one-device run and writes one checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats

from dpltm.dp.distributed import Distribution, all_reduce_sum, check_launch, rank_sampling_seed, shard
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.dp.sampling import PoissonBatches
from dpltm.dp.step import private_gradients
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.training.private import check_replicas_agree
from tests.datafiles import write_digits

N, Q, SEED, SIGMA, CLIP = 300, 0.2, 11, 1.3, 0.5


def shards_union(world: int, steps: int) -> list[torch.Tensor]:
    per_rank = [iter(PoissonBatches(N, Q, steps, rank_sampling_seed(SEED, r), shard=shard(N, r, world)))
                for r in range(world)]
    return [torch.cat([next(it) for it in per_rank]) for _ in range(steps)]


def test_shards_partition_the_records() -> None:
    parts = [shard(N, r, 3) for r in range(3)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(N))  # type: ignore[arg-type]
    assert shard(N, 0, 1) is None
    assert rank_sampling_seed(SEED, 0) == SEED + 1  # one device: the seed it always used


def test_union_of_shard_batches_includes_each_record_with_probability_q() -> None:
    steps = 400
    counts = torch.zeros(N)
    for batch in shards_union(3, steps):
        assert batch.unique().numel() == batch.numel()  # no record twice
        counts[batch] += 1
    # every record's count is Binomial(steps, q): test the pooled count and the spread across records
    total = int(counts.sum())
    assert stats.binomtest(total, N * steps, Q).pvalue > 1e-3
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4


def test_distribution_checks() -> None:
    assert Distribution(2, 3).world_size == 6 and Distribution(2).multi_process and not Distribution().multi_process
    with pytest.raises(DpltmUserError, match="--strategy"):
        Distribution(2, strategy="ddp_spawn")
    with pytest.raises(DpltmUserError, match="--devices"):
        Distribution(0)


@pytest.mark.parametrize("port", ["abc", "99999", "0", "-1", "", "８０８０"])
def test_a_master_port_that_is_no_port_is_refused_before_any_process_starts(port: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed would fail on it in every rank with a traceback, after the data was loaded."""
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(DpltmUserError, match="MASTER_PORT"):
        check_launch(Distribution(2))
    check_launch(Distribution())  # one process: no port is used
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_launch(Distribution(2))


@pytest.mark.parametrize("address", ["nonexistent.invalid", "", "bad host name"])
def test_a_master_address_that_does_not_resolve_is_refused_before_any_process_starts(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed retries an unresolvable address once a second, forever."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", address)
    with pytest.raises(DpltmUserError, match="MASTER_ADDR"):
        check_launch(Distribution(2))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    check_launch(Distribution(2))
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    check_launch(Distribution(2))


def test_more_processes_than_the_node_can_run_are_refused_before_any_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--devices 100000` on the CPU once started that many gloo processes: refused in one line now."""
    from dpltm.dp import distributed

    monkeypatch.setattr(distributed, "available_cores", lambda: 2)
    cpu = torch.device("cpu")
    assert distributed.local_device(cpu, Distribution(2)) == cpu
    with pytest.raises(DpltmUserError, match="--devices 3 on the CPU .* 2 core"):
        distributed.local_device(cpu, Distribution(3))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DpltmUserError, match="--devices 100000: this node has 1 CUDA device"):
        distributed.local_device(torch.device("cuda"), Distribution(100000))


def ticket() -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(12, 5, (10, 7), None), torch.Generator().manual_seed(0))
    masks = model.full_masks()
    for _ in range(2):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model.double(), masks


def records() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (N,), generator=g)


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        (model, masks), (x, y) = ticket(), records()
        layout = MaskLayout.of(model, masks, x.dtype)
        index = next(iter(PoissonBatches(N, Q, 1, rank_sampling_seed(SEED, rank), shard=shard(N, rank, world))))
        results = {"index": index}
        for sigma in (0.0, SIGMA):
            generator = torch.Generator().manual_seed(SEED + rank)  # rank 0's: the only one used
            grads, _, _ = private_gradients(model, x[index], y[index], clip=CLIP, noise=GaussianNoise(sigma),
                                            expected_batch_size=N * Q, generator=generator, layout=layout,
                                            reduce=all_reduce_sum, add_noise=rank == 0)
            results[f"sigma={sigma}"] = grads
        check_replicas_agree(model)  # same weights everywhere: passes
        with torch.no_grad():
            next(model.parameters()).add_(float(rank))  # rank 1 diverges
        try:
            check_replicas_agree(model)
            results["divergence caught"] = False
        except RuntimeError:
            results["divergence caught"] = True
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_step_equals_one_process_over_the_union(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    union = torch.cat([r["index"] for r in ranks])
    assert union.numel() > 0 and union.unique().numel() == union.numel()
    assert all(r["divergence caught"] for r in ranks)  # every rank sees it
    (model, masks), (x, y) = ticket(), records()
    layout = MaskLayout.of(model, masks, x.dtype)
    clipped = clipped_gradient_sum(model, x[union], y[union], CLIP, layout).grad_sums
    for sigma in (0.0, SIGMA):
        one = private_gradients(model, x[union], y[union], clip=CLIP, noise=GaussianNoise(sigma),
                                expected_batch_size=N * Q, generator=torch.Generator().manual_seed(SEED),
                                layout=layout)[0]
        for name, expected in one.items():
            assert torch.equal(ranks[0][f"sigma={sigma}"][name], ranks[1][f"sigma={sigma}"][name])  # one ĝ
            torch.testing.assert_close(ranks[0][f"sigma={sigma}"][name], expected, rtol=1e-12, atol=1e-12)
            if sigma == 0.0:  # no noise: ĝ is the all-reduced clipped sum over L
                torch.testing.assert_close(ranks[0][f"sigma={sigma}"][name] * (N * Q), clipped[name],
                                           rtol=1e-12, atol=1e-12)
    # masked weights got exactly zero (noise only on surviving coordinates)
    by_parameter = dict(masks)
    assert set(by_parameter) == {w for w, _ in layout.parameter_names}
    for name, mask in by_parameter.items():
        assert bool((ranks[0][f"sigma={SIGMA}"][name][~mask] == 0).all())


def _cli(*args: str, cwd: Path, data: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPLTM_DATA_DIR": str(data), "COLUMNS": "100"}
    for launcher_variable in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", *args], cwd=cwd, env=env, text=True,
                            capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_cli_ddp_on_two_processes_reports_the_one_device_epsilon(tmp_path: Path) -> None:
    data = write_digits(tmp_path / "data")
    common = ("train", "--dense", "--dataset", "digits", "--eps2", "1", "--epochs", "2", "--batch-size", "32",
              "--device", "cpu", "--json")
    # no --noise-seed: each process draws its own CSPRNG seed, and rank 0's must reach every rank (the
    # run checks at the end that the replicas agree, i.e. that they added the same noise)
    two = _cli(*common, "--devices", "2", "--strategy", "ddp", "--out", "two.pt", cwd=tmp_path, data=data)
    one = _cli(*common, "--no-progress", "--noise-seed", "3", "--out", "one.pt", cwd=tmp_path, data=data)
    two_report, one_report = json.loads(two.stdout), json.loads(one.stdout)  # one JSON document each
    assert two_report["processes"] == 2 and one_report["processes"] == 1
    for key in ("epsilon", "epsilon_dp_part", "noise_multiplier", "sample_rate", "steps", "privacy", "delta"):
        assert two_report[key] == one_report[key], key
    assert "2 processes (DDP)" in two.stderr and two.stderr.count("test accuracy") == 1  # rank 0 reports
    assert two_report["test_accuracy"] > 0.5  # it trained
    saved = torch.load(tmp_path / "two.pt", weights_only=False)
    assert saved["outcome"]["processes"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == ["one.pt", "two.pt"]
