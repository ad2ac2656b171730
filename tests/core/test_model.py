"""The masked network: pruned weights are exactly zero and never move; rewinding is exact."""

from __future__ import annotations

import pytest
import torch

from dpltm.errors import DpltmUserError
from dpltm.model import ACTIVATIONS, Architecture, MaskedMLP, activation_function, build_architecture, density
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.tickets.imp import rewind
from dpltm.training.plain import accuracy, train_classifier


def pruned_model(seed: int = 0, rounds: int = 2) -> MaskedMLP:
    model = MaskedMLP(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(seed))
    for _ in range(rounds):
        model.set_masks(prune_layerwise(model.weights(), model.masks(),
                                        paper_prune_rates(model.mask_names())))
    return model


def test_pruned_weights_stay_exactly_zero_through_training(tiny_splits) -> None:  # type: ignore[no-untyped-def]
    model = pruned_model()
    masks = {k: v.clone() for k, v in model.masks().items()}
    train_classifier(model, tiny_splits.train, steps=60, batch_size=32, lr=0.5, seed=0)
    for name, weight in model.weights().items():
        assert torch.count_nonzero(weight[~masks[name]]) == 0, name
        assert torch.equal(model.masks()[name], masks[name])
    assert accuracy(model, tiny_splits.val) > 0.5  # it did learn


def test_forward_ignores_raw_values_at_pruned_positions() -> None:
    model = pruned_model()
    x = torch.randn(5, 20)
    before = model(x)
    with torch.no_grad():
        for name, weight in model.weights().items():
            weight[~model.masks()[name]] = 123.0  # corrupt the pruned coordinates
    assert torch.equal(model(x), before)


def test_gradient_is_zero_on_pruned_weights() -> None:
    model = pruned_model()
    model(torch.randn(7, 20)).sum().backward()
    for name, weight in model.weights().items():
        assert weight.grad is not None
        assert torch.count_nonzero(weight.grad[~model.masks()[name]]) == 0


def test_rewinding_restores_theta0_exactly_on_survivors(tiny_splits) -> None:  # type: ignore[no-untyped-def]
    model = MaskedMLP(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(3))
    theta0 = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mask_")}
    train_classifier(model, tiny_splits.train, steps=20, batch_size=32, lr=0.5, seed=0)
    masks = prune_layerwise(model.weights(), model.masks(), paper_prune_rates(model.mask_names()))
    rewind(model, theta0, masks)
    for name, weight in model.weights().items():
        keep = masks[name]
        assert torch.equal(weight[keep], theta0[_param_key(name)][keep])
        assert torch.count_nonzero(weight[~keep]) == 0
    for key, value in theta0.items():
        if key.endswith("bias"):
            assert torch.equal(model.state_dict()[key], value)


def _param_key(mask_name: str) -> str:
    layer, _ = mask_name.rsplit(".", 1)
    return f"layers.{layer.replace('.', '_')}.weight"


def test_masks_are_checked_values() -> None:
    model = pruned_model(rounds=0)
    good = model.masks()
    with pytest.raises(DpltmUserError, match="missing"):
        model.set_masks({k: v for k, v in list(good.items())[1:]})
    with pytest.raises(DpltmUserError, match="shape"):
        model.set_masks({**good, "output.weight": torch.ones(3, 3, dtype=torch.bool)})
    with pytest.raises(DpltmUserError, match="0 and 1"):
        model.set_masks({**good, "output.weight": torch.full((4, 8), 0.5)})


def test_projection_layer_has_no_activation_and_is_prunable() -> None:
    arch = build_architecture(10, 3, (6,), project_to=8)
    model = MaskedMLP(arch, torch.Generator().manual_seed(0))
    assert model.mask_names() == ["project.weight", "hidden.0.weight", "output.weight"]
    assert arch.layer_shapes()["project"] == (8, 10)
    assert arch.layer_shapes()["hidden.0"] == (6, 8)
    assert not model.is_activation_after(0) and model.is_activation_after(1)
    assert model(torch.randn(2, 10)).shape == (2, 3)
    assert density(model.masks()) == 1.0


def test_same_seed_same_init() -> None:
    a = MaskedMLP(build_architecture(20, 4, (16,), None), torch.Generator().manual_seed(5))
    b = MaskedMLP(build_architecture(20, 4, (16,), None), torch.Generator().manual_seed(5))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_activation_is_part_of_the_architecture() -> None:
    arch = build_architecture(10, 3, (6, 5), None, activation="tanh")
    assert Architecture.from_dict(arch.to_dict()) == arch
    with pytest.raises(KeyError):  # no default: every file of the current format records it
        Architecture.from_dict({k: v for k, v in arch.to_dict().items() if k != "activation"})
    assert build_architecture(10, 3, (6,), None).activation == "relu"  # the default is the paper's
    with pytest.raises(DpltmUserError, match="--activation must be one of relu, tanh, got 'gelu'"):
        build_architecture(10, 3, (6,), None, activation="gelu")
    with pytest.raises(DpltmUserError, match="--activation"):
        activation_function("sigmoid")
    assert set(ACTIVATIONS) == {"relu", "tanh"}


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_forward_uses_the_architectures_activation(activation: str) -> None:
    model = MaskedMLP(build_architecture(10, 3, (6, 5), 8, activation), torch.Generator().manual_seed(0))
    model.set_masks(prune_layerwise(model.weights(), model.masks(), paper_prune_rates(model.mask_names())))
    act = {"relu": torch.relu, "tanh": torch.tanh}[activation]
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    layers = [(model.layers[n.removesuffix(".weight").replace(".", "_")], m) for n, m in model.masks().items()]
    h = x
    for i, (layer, mask) in enumerate(layers):
        h = torch.nn.functional.linear(h, layer.weight * mask, layer.bias)
        if i not in (0, len(layers) - 1):  # none after the projection or the output
            h = act(h)
    torch.testing.assert_close(model(x), h)
