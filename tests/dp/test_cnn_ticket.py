"""The built-in network with a convolutional front (`--arch lenet5`): masked per-sample norms and
clipped sums against torch.func, the static-shape step, and the CLI pipeline on 28×28 images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, apply_masks_
from dpltm.networks.lenet import Architecture, LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.datafiles import write_mnist
from tests.dp.reference import masked_reference, padded_chunks


def cnn_ticket(rounds: int = 2, activation: str = "tanh") -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(784, 10, (20, 12), None, activation, "lenet5"),
                  torch.Generator().manual_seed(0)).double()
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model, masks


def images(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 784, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_cnn_norms_and_sums_equal_torch_func(activation: str) -> None:
    model, masks = cnn_ticket(activation=activation)
    x, y = images(7)
    assert "conv.0.weight" in masks and "conv.1.weight" in masks
    ref = masked_reference(model, masks, x, y)
    expected = ref.clipped_sum
    layout = MaskLayout.of(model, masks, torch.float64)
    got = clipped_gradient_sum(model, x, y, ref.clip, layout)
    torch.testing.assert_close(got.norms, ref.norms)
    assert list(got.grad_sums) == layout.all_parameter_names and set(got.grad_sums) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got.grad_sums[name], value, msg=name)
    conv0 = masks["conv.0.weight"]
    assert bool((got.grad_sums["conv.0.weight"][~conv0] == 0).all())
    assert layout.surviving["conv.0.weight"] is not None and first_layer_input_terms(x, layout) is None


def test_cnn_padded_chunks_and_empty_batch() -> None:
    model, masks = cnn_ticket()
    x, y = images(20)
    x[0] = float("nan")
    index = torch.arange(1, 20)
    layout = MaskLayout.of(model, masks, torch.float64, allow_sparse=False)
    eager = clipped_gradient_sum(model, x[index], y[index], 0.5, layout).grad_sums
    total = {k: torch.zeros_like(v) for k, v in eager.items()}
    for chunk in padded_chunks(index, 8, torch.float64):
        part = clipped_gradient_sum(model, x[chunk.index], y[chunk.index], 0.5, layout, row_clips=chunk.weight * 0.5)
        for k in total:
            total[k] += part.grad_sums[k]
    for k in eager:
        torch.testing.assert_close(total[k], eager[k], rtol=1e-12, atol=1e-12)
    empty = clipped_gradient_sum(model, x[:0], y[:0], 0.5, layout)
    assert list(empty.grad_sums) == layout.all_parameter_names


def test_architecture_record_round_trips_and_checks_the_image() -> None:
    arch = build_architecture(784, 10, (120, 84), None, "relu", "lenet5")
    assert Architecture.from_dict(arch.to_dict()) == arch and arch.flat_features() == 256
    assert "conv" not in build_architecture(784, 10, (300, 100), None).to_dict()  # MLP records unchanged
    with pytest.raises(DpltmUserError, match="square"):
        build_architecture(561, 6, (120, 84), None, "relu", "lenet5")
    with pytest.raises(DpltmUserError, match="too small"):
        build_architecture(64, 10, (120, 84), None, "relu", "lenet5")


def dpltm(*args: str, cwd: Path, data: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DPLTM_DATA_DIR": str(data), "COLUMNS": "100"}
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", *args], cwd=cwd, env=env, text=True,
                            capture_output=True, timeout=600)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_cli_lenet5_ticket_generate_select_train(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=300, n_test=60)
    write_mnist(data, "KMNIST", n_train=300, n_test=60)
    dpltm("generate", "--dataset", "kmnist", "--arch", "lenet5", "--rounds", "2", "--iterations", "30",
          "--batch-size", "32", "--device", "cpu", "--out", "t.pt", "--no-progress", cwd=tmp_path, data=data)
    dpltm("select", "--tickets", "t.pt", "--best", "--out", "w.pt", cwd=tmp_path, data=data)
    report = json.loads(dpltm("train", "--ticket", "w.pt", "--dataset", "mnist", "--eps2", "1", "--epochs", "2",
                              "--batch-size", "32", "--device", "cpu", "--out", "m.pt", "--no-progress", "--json",
                              cwd=tmp_path, data=data).stdout)
    assert report["end_to_end_dp"] is True and 0.95 < report["epsilon"] <= 1.0
    assert report["transfer"]["kept_layers"][:2] == ["conv.0", "conv.1"]
    body = torch.load(tmp_path / "m.pt", weights_only=True)
    state = body["state_dict"]
    for layer in ("conv_0", "conv_1", "hidden_0"):
        mask = state[f"mask_{layer}_weight"]
        assert float(mask.float().mean()) < 0.6 and bool((state[layer.replace("_", ".") + ".weight"][~mask] == 0).all())
    dense = json.loads(dpltm("train", "--dense", "--arch", "lenet5", "--dataset", "mnist", "--eps2", "1", "--epochs",
                             "1", "--batch-size", "32", "--device", "cpu", "--out", "d.pt", "--no-progress", "--json",
                             cwd=tmp_path, data=data).stdout)
    assert dense["transfer"] == {"mode": "dense", "activation": "relu", "arch": "lenet5"}
    chosen = json.loads(dpltm("select", "--tickets", "t.pt", "--noise-aware", "--private-size", "300", "--eps2", "1",
                              "--epochs", "1", "--batch-size", "32", "--out", "n.pt", "--json", cwd=tmp_path,
                              data=data).stdout)  # convolutional candidates through the DP step itself
    assert chosen["selection"]["method"] == "noise-aware", chosen
    assert len(chosen["selection"]["noise_aware"]["candidates"]) == 3
    for args, message in [
        (("train", "--ticket", "w.pt", "--arch", "lenet5", "--dataset", "mnist", "--eps2", "1"),
         "--arch is for --dense"),
        (("train", "--ticket", "w.pt", "--dataset", "mnist", "--eps2", "1", "--noise", "dpd", "--out", "x.pt"),
         "--noise dpd"),
        (("generate", "--dataset", "digits", "--arch", "lenet5"), "too small"),
    ]:
        failed = dpltm(*args, cwd=tmp_path, data=data, ok=False)
        assert message in failed.stderr and "Traceback" not in failed.stderr
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dpltm: error:"), failed.stderr  # refused before any work
