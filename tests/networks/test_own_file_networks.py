"""Networks of their own files (`dpltm/networks/`, `--arch dp-cnn`): built from the catalogue line,
plain `nn.Module`s whose masks are keyed by parameter name, trained by the DP engine's rules (the same
masked clipping and noise as the built-in networks' fused step), and carried through every stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpltm.architectures import ARCHITECTURES
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.step import EngineLayout, apply_gradients, private_gradients, step_layout
from dpltm.errors import DpltmUserError
from dpltm.masks import apply_masks_, full_masks, prunable_weights
from dpltm.networks.lenet import Architecture, LeNet, build_architecture, build_network
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.datafiles import write_mnist
from tests.dp.reference import masked_reference

OWN_FILES = [name for name, entry in ARCHITECTURES.items() if entry.module is not None]


def test_there_is_a_network_of_its_own_file() -> None:
    assert "dp-cnn" in OWN_FILES


@pytest.mark.parametrize("name", OWN_FILES)
def test_a_network_of_its_own_file_builds_from_its_catalogue_line(name: str) -> None:
    hidden = ARCHITECTURES[name].default_hidden
    arch = build_architecture(784, 10, (32,) if hidden is None else hidden, None, "tanh", name)
    assert arch.name == name and not arch.is_mlp
    assert Architecture.from_dict(arch.to_dict()) == arch and arch.to_dict()["name"] == name
    a, b = build_network(arch, torch.Generator().manual_seed(3)), build_network(arch, torch.Generator().manual_seed(3))
    assert not isinstance(a, LeNet) and a.arch == arch  # type: ignore[union-attr]
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())  # seeded init
    assert list(a.buffers()) == []  # masks are data beside the model
    shapes = {n: tuple(w.shape) for n, w in prunable_weights(a).items()}
    assert {f"{layer}.weight": shape for layer, shape in arch.layer_shapes().items()} == shapes
    assert a(torch.rand(3, 784)).shape == (3, 10)


def test_the_dp_cnn_is_the_benchmarks_network() -> None:
    net = build_network(build_architecture(784, 10, (32,), None, "tanh", "dp-cnn"))
    assert {n: tuple(p.shape) for n, p in net.named_parameters()} == {
        "conv.0.weight": (16, 1, 8, 8), "conv.0.bias": (16,), "conv.1.weight": (32, 16, 4, 4), "conv.1.bias": (32,),
        "hidden.0.weight": (32, 512), "hidden.0.bias": (32,), "output.weight": (10, 32), "output.bias": (10,)}
    with pytest.raises(DpltmUserError, match="at least 14×14"):
        build_architecture(64, 10, (32,), None, "tanh", "dp-cnn")  # 8×8 digits: refused before any data is read
    with pytest.raises(DpltmUserError, match="--project-to"):
        Architecture(784, (32,), 10, 64, "tanh", name="dp-cnn")
    for hidden, classes in (((0,), 10), ((32,), 0), ((-1,), 10)):  # a damaged record: one line, no traceback
        with pytest.raises(DpltmUserError, match="positive"):
            Architecture(784, hidden, classes, None, "tanh", name="dp-cnn")
    with pytest.raises(DpltmUserError, match="at most 1e"):
        Architecture(784, (10**5, 10**5), 10, None, "tanh", name="dp-cnn")
    with pytest.raises(DpltmUserError, match="lists no 'conv'"):
        Architecture(784, (32,), 10, None, "tanh", ((6, 5),), name="dp-cnn")


def _ticket(rounds: int = 2) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = build_network(build_architecture(784, 10, (32,), None, "tanh", "dp-cnn"),
                          torch.Generator().manual_seed(0)).double()
    masks = full_masks(model)
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(prunable_weights(model), masks,
                                                    paper_prune_rates(list(prunable_weights(model)))))
    return model, masks


def test_the_engine_step_is_masked_clipping_and_masked_noise() -> None:
    model, masks = _ticket()
    layout = step_layout(model, masks, torch.float64)
    assert isinstance(layout, EngineLayout)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 784, generator=g, dtype=torch.float64), torch.randint(0, 10, (12,), generator=g)
    ref = masked_reference(model, masks, x, y)
    clip, norms = ref.clip, ref.norms
    expected = {n: total / 10.0 for n, total in ref.clipped_sum.items()}
    grads, got_norms, _ = private_gradients(model, x, y, clip=clip, noise=GaussianNoise(0.0), expected_batch_size=10.0,
                                            generator=torch.Generator().manual_seed(0), layout=layout)
    torch.testing.assert_close(got_norms, norms, rtol=1e-9, atol=1e-9)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-9, atol=1e-9)
    noisy, _, _ = private_gradients(model, x, y, clip=clip, noise=GaussianNoise(3.0), expected_batch_size=10.0,
                                    generator=torch.Generator().manual_seed(0), layout=layout)
    for n, mask in masks.items():
        assert bool((noisy[n][~mask] == 0).all()) and bool((noisy[n][mask] != expected[n][mask]).any()), n


def test_frozen_layers_are_left_out_of_clipping_noise_and_the_update() -> None:
    """Layers fixed at their (public) weights: norms and sums over the trainable parameters only, no noise
    or update for the frozen ones, and the ticket's pruned weights stay zero."""
    model, masks = _ticket()
    for p in (*model.conv.parameters(), model.hidden[0].bias):  # type: ignore[union-attr]
        p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    layout = step_layout(model, masks, torch.float64)
    assert set(layout.surviving) == {"hidden.0.weight", "output.weight", "output.bias"}  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 784, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)
    reference = masked_reference(model, masks, x, y)
    grads, norms, _ = private_gradients(model, x, y, clip=reference.clip, noise=GaussianNoise(1.0),
                                        expected_batch_size=8.0, generator=torch.Generator().manual_seed(0),
                                        layout=layout)
    assert set(grads) == {"hidden.0.weight", "output.weight", "output.bias"}
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-9)
    apply_gradients(model, grads, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    parameters = dict(model.named_parameters())
    for name, mask in masks.items():
        assert bool((parameters[name][~mask] == 0).all()), name


def test_noise_geometries_and_static_steps_are_for_the_built_in_networks() -> None:
    model, masks = _ticket(rounds=0)
    with pytest.raises(DpltmUserError, match="--noise gaussian"):
        step_layout(model, masks, torch.float64, {"hidden.0.weight": torch.ones(32, 512)})


@pytest.mark.slow
def test_cli_dp_cnn_generate_select_train_export_predict(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=300, n_test=60)
    write_mnist(data, "KMNIST", n_train=300, n_test=60)
    env = {"DPLTM_DATA_DIR": str(data)}
    cli("generate", "--dataset", "kmnist", "--arch", "dp-cnn", "--activation", "tanh", "--rounds", "2",
        "--iterations", "20", "--batch-size", "32", "--device", "cpu", "--out", str(tmp_path / "t.pt"),
        "--no-progress", env=env)
    cli("select", "--tickets", str(tmp_path / "t.pt"), "--noise-aware", "--private-size", "270", "--eps", "1",
        "--epochs", "1", "--batch-size", "32", "--out", str(tmp_path / "w.pt"), env=env)
    report = json.loads(cli("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "mnist", "--eps2", "1",
                            "--epochs", "1", "--batch-size", "32", "--device", "cpu", "--out", str(tmp_path / "m.pt"),
                            "--no-progress", "--json", env=env).stdout)
    assert report["end_to_end_dp"] is True and 0.9 < report["epsilon"] <= 1.0
    state = torch.load(tmp_path / "m.pt", weights_only=True)["state_dict"]
    for layer in ("conv.0", "conv.1", "hidden.0"):
        mask = state["mask_" + layer.replace(".", "_") + "_weight"]
        assert bool((state[f"{layer}.weight"][~mask] == 0).all()), layer
    cli("export", "--model", str(tmp_path / "m.pt"), "--out", str(tmp_path / "m.safetensors"))
    predicted = json.loads(cli("predict", "--model", str(tmp_path / "m.safetensors"), "--dataset", "mnist",
                               "--json", env=env).stdout)
    assert predicted["accuracy"] == pytest.approx(report["test_accuracy"])
    refused = cli("train", "--ticket", str(tmp_path / "w.pt"), "--dataset", "mnist", "--eps2", "1", "--noise", "dpd",
                  "--out", str(tmp_path / "x.pt"), "--no-progress", env=env, ok=False)
    assert "--noise dpd" in refused.output and "Traceback" not in refused.output
