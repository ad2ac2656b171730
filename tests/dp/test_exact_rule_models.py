"""Models built only of layers with exact rules train through the engine without ever calling the
torch.func fallback: a GroupNorm CNN, and a tiny transformer-like model (Embedding → LayerNorm → Linear
on (B, T, d) → mean over T → Linear). Their norms and clipped sums equal torch.func's over the whole
model, masked or not, and masked weights stay exactly zero through `make_private`'s DP steps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import dpltm
from dpltm.dp.engine import clipped_gradient_sum_of, prunable_weight_names
from dpltm.dp.rules import FuncRule, LayerCall
from tests.dp.reference import masked_reference


class TinyTransformer(nn.Module):
    """Token embedding, layer norm, a token-wise linear map on the sequence, mean pooling, a head."""

    def __init__(self, vocabulary: int = 20, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mix(self.norm(self.embed(ids))))
        return self.head(h.mean(dim=1))


def group_norm_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.Conv2d(4, 6, 3, stride=2), nn.GroupNorm(3, 6), nn.Tanh(), nn.Flatten(),
                         nn.Linear(6 * 3 * 3, 3))


def images(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 1, 8, 8, generator=g)


def tokens(n: int, g: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, 20, (n, 6), generator=g)
    ids[:, -2:] = torch.where(torch.rand(n, 2, generator=g) < 0.5, 0, ids[:, -2:])  # some padding
    ids[:, 1] = ids[:, 0]  # a repeated id in every sample
    return ids


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], torch.Tensor]]] = {
    "group-norm-cnn": (group_norm_cnn, images),
    "tiny-transformer": (TinyTransformer, tokens),
}


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch.func rule raises if any layer reaches it."""
    def refuse(self: FuncRule, call: LayerCall, g: torch.Tensor) -> dict[str, torch.Tensor]:
        raise AssertionError(f"layer {call.name} ({type(call.module).__name__}) went through the torch.func fallback")
    monkeypatch.setattr(FuncRule, "per_sample_grads", refuse)


def weight_masks(model: nn.Module, g: torch.Generator, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Random 0/1 masks on the named weights (default: every weight, normalisation layers' too)."""
    return {name: torch.rand(p.shape, generator=g) < 0.6 for name, p in model.named_parameters()
            if (name.endswith("weight") if names is None else name in names)}


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("masked", [False, True])
def test_norms_and_sums_equal_torch_func_without_the_fallback(name: str, masked: bool) -> None:
    build, data = MODELS[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build().double()
    x = data(10, g)
    x = x.double() if x.is_floating_point() else x
    y = torch.randint(0, 3, (10,), generator=g)
    masks = weight_masks(model, g) if masked else {}
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key in masks:
                p.mul_(masks[key])
    clip = float(masked_reference(model, masks, x, y).clip)  # the median norm: half the samples clipped
    expected = masked_reference(model, masks, x, y, clip)
    got = clipped_gradient_sum_of(model, x, y, clip, masks)
    torch.testing.assert_close(got.norms, expected.norms, rtol=1e-6, atol=1e-12)
    for key, value in expected.clipped_sum.items():
        torch.testing.assert_close(got.grad_sums[key], value, rtol=1e-6, atol=1e-12, msg=key)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("name", list(MODELS))
def test_dp_steps_keep_masked_weights_exactly_zero(name: str) -> None:
    build, data = MODELS[name]
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = build()
    x, y = data(60, g), torch.randint(0, 3, (60,), generator=g)
    masks = weight_masks(model, g, prunable_weight_names(model))  # what a ticket may mask
    assert len(masks) == 3
    before = {key: p.detach().clone() for key, p in model.named_parameters()}
    private = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), (x, y), noise_multiplier=1.0,
                                 epochs=1, batch_size=15, masks=masks, masks_from="random mask", noise_seed=2)
    private.fit()
    assert private.steps_done == 4
    for key, p in model.named_parameters():
        if key in masks:
            assert bool((p[~masks[key]] == 0).all()), key
            assert not torch.equal(p[masks[key]], before[key][masks[key]]), key  # the survivors trained
