"""The built-in network and its ticket: masks are data beside a plain module; pruned weights are
exactly zero and never move; rewinding is exact."""

from __future__ import annotations

import pytest
import torch

from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, PrunedWeights, apply_masks_, density, rewind, split_stored_state, stored_state
from dpltm.networks.lenet import ACTIVATIONS, Architecture, LeNet, activation_function, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from dpltm.training.plain import accuracy, train_classifier


def pruned_model(seed: int = 0, rounds: int = 2) -> tuple[LeNet, Masks]:
    model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(seed))
    masks = model.full_masks()
    for _ in range(rounds):
        masks = apply_masks_(model, prune_layerwise(model.weights(), masks, paper_prune_rates(model.mask_names())))
    return model, masks


def test_the_model_holds_no_masks() -> None:
    model, masks = pruned_model()
    assert all(not k.startswith("mask") for k in model.state_dict())
    assert list(model.buffers()) == []
    assert set(masks) == set(model.mask_names())


def test_pruned_weights_stay_exactly_zero_through_training(tiny_splits) -> None:  # type: ignore[no-untyped-def]
    model, masks = pruned_model()
    train_classifier(model, tiny_splits.train, masks=masks, steps=60, batch_size=32, lr=0.5, seed=0)
    for name, weight in model.weights().items():
        assert torch.count_nonzero(weight[~masks[name]]) == 0, name
    assert accuracy(model, tiny_splits.val) > 0.5  # it did learn


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=0.1),
])
def test_pruned_weights_stay_zero_whatever_the_optimiser(make_optimizer) -> None:  # type: ignore[no-untyped-def]
    model, masks = pruned_model()
    keep_pruned = PrunedWeights(model, masks)
    optimizer = make_optimizer(model.parameters())
    x, y = torch.randn(32, 20), torch.randint(0, 4, (32,))
    survivors = {n: w.detach().clone() for n, w in model.weights().items()}
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        keep_pruned()
    for name, weight in model.weights().items():
        assert torch.count_nonzero(weight[~masks[name]]) == 0, name
        assert not torch.equal(weight[masks[name]], survivors[name][masks[name]])  # the survivors did move


def test_installing_a_ticket_zeroes_exactly_its_pruned_weights() -> None:
    model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(0))
    before = {n: w.detach().clone() for n, w in model.weights().items()}
    masks = prune_layerwise(model.weights(), model.full_masks(), paper_prune_rates(model.mask_names()))
    installed = apply_masks_(model, masks)
    for name, weight in model.weights().items():
        assert installed[name].dtype == torch.bool and torch.equal(installed[name], masks[name])
        assert torch.equal(weight[masks[name]], before[name][masks[name]])
        assert torch.count_nonzero(weight[~masks[name]]) == 0


def test_the_forward_pass_is_the_dense_networks() -> None:
    model, _ = pruned_model()
    dense = LeNet(model.arch)
    dense.load_state_dict(model.state_dict())
    x = torch.randn(5, 20)
    assert torch.equal(model(x), dense(x))


def test_a_model_file_keeps_the_masks_beside_the_weights() -> None:
    model, masks = pruned_model()
    state = stored_state(model, masks)
    assert state["mask_hidden_0_weight"].dtype == torch.bool
    weights, back = split_stored_state(model.arch, state)
    assert weights.keys() == model.state_dict().keys()
    assert back.keys() == masks.keys() and all(torch.equal(back[n], masks[n]) for n in masks)


def test_rewinding_restores_theta0_exactly_on_survivors(tiny_splits) -> None:  # type: ignore[no-untyped-def]
    model = LeNet(build_architecture(20, 4, (16, 8), None), torch.Generator().manual_seed(3))
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}
    train_classifier(model, tiny_splits.train, steps=20, batch_size=32, lr=0.5, seed=0)
    masks = prune_layerwise(model.weights(), model.full_masks(), paper_prune_rates(model.mask_names()))
    rewind(model, theta0, masks)
    for name, weight in model.weights().items():
        keep = masks[name]
        assert torch.equal(weight[keep], theta0[name][keep])
        assert torch.count_nonzero(weight[~keep]) == 0
    for key, value in theta0.items():
        if key.endswith("bias"):
            assert torch.equal(model.state_dict()[key], value)


def test_masks_are_checked_values() -> None:
    model, good = pruned_model(rounds=0)
    with pytest.raises(DpltmUserError, match="missing"):
        apply_masks_(model, {k: v for k, v in list(good.items())[1:]})
    with pytest.raises(DpltmUserError, match="shape"):
        apply_masks_(model, {**good, "output.weight": torch.ones(3, 3, dtype=torch.bool)})
    with pytest.raises(DpltmUserError, match="0 and 1"):
        apply_masks_(model, {**good, "output.weight": torch.full((4, 8), 0.5)})


def test_projection_layer_has_no_activation_and_is_prunable() -> None:
    arch = build_architecture(10, 3, (6,), project_to=8)
    model = LeNet(arch, torch.Generator().manual_seed(0))
    assert model.mask_names() == ["project.weight", "hidden.0.weight", "output.weight"]
    assert arch.layer_shapes()["project"] == (8, 10)
    assert arch.layer_shapes()["hidden.0"] == (6, 8)
    assert not model.is_activation_after(0) and model.is_activation_after(1)
    assert model(torch.randn(2, 10)).shape == (2, 3)
    assert density(model.full_masks()) == 1.0


def test_same_seed_same_init() -> None:
    a = LeNet(build_architecture(20, 4, (16,), None), torch.Generator().manual_seed(5))
    b = LeNet(build_architecture(20, 4, (16,), None), torch.Generator().manual_seed(5))
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
    model = LeNet(build_architecture(10, 3, (6, 5), 8, activation), torch.Generator().manual_seed(0))
    masks = apply_masks_(model, prune_layerwise(model.weights(), model.full_masks(),
                                                paper_prune_rates(model.mask_names())))
    act = {"relu": torch.relu, "tanh": torch.tanh}[activation]
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    layers = [(model.get_submodule(n.removesuffix(".weight")), m) for n, m in masks.items()]
    h = x
    for i, (layer, mask) in enumerate(layers):
        h = torch.nn.functional.linear(h, layer.weight * mask, layer.bias)
        if i not in (0, len(layers) - 1):  # none after the projection or the output
            h = act(h)
    torch.testing.assert_close(model(x), h)
