"""Every registered layer rule, layer by layer, against torch.func: the masked per-sample squared norms
and the clipped sum Σ_i c_i ∇ℓ_i ⊙ M of ⟨z_i, g_i⟩ for random output gradients g, over shapes, masks on
the weight and the bias, and each layer's options (Linear on sequences both through the Gram ghost norm
and the formed gradients; Conv1d padding, stride, dilation, groups and padding modes; GroupNorm's
groups; LayerNorm's normalised dimensions; Embedding's repeated ids, padding index and frequency
scaling); a row with a non-finite gradient adds exactly zero to the sum."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

from dpltm.dp.conv_ghost import GROUPED_MIN_POSITIONS, forms_by_groups, grams_cost_less, use_grams
from dpltm.dp.rules import RULES, FuncRule, LayerCall, rule_for
from dpltm.dp.rules.embedding import use_gram
from dpltm.dp.rules.linear import SEQUENCE

EXAMPLES = settings(max_examples=25, deadline=None)


def per_sample_reference(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """∇_θ ⟨layer(x_i), g_i⟩ for each sample, by torch.func."""
    params = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}

    def inner(p: dict[str, torch.Tensor], xi: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
        return (functional_call(layer, p, (xi[None],)) * gi[None]).sum()

    return vmap(grad(inner), in_dims=(None, 0, 0))(params, x, g)


def random_masks(layer: nn.Module, generator: torch.Generator, which: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """0/1 float masks (as the engine passes them) on the named parameters the layer has."""
    return {n: (torch.rand(p.shape, generator=generator) < 0.6).to(p.dtype) for n, p in layer.named_parameters()
            if n in which}


def check_rule(layer: nn.Module, x: torch.Tensor, generator: torch.Generator,
               masked: tuple[str, ...] = ()) -> Any:
    """The rule's norms and clipped sums equal torch.func's to 1e-6 relative; returns the rule's state."""
    layer = layer.double()
    rule = rule_for(layer)
    assert not isinstance(rule, FuncRule), f"{type(layer).__name__} has no rule of its own"
    rule.check("layer", layer)
    out = layer(x)
    g = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    masks = random_masks(layer, generator, masked)
    call = LayerCall("layer", layer)
    call.record(layer, (x,), {}, out)

    expected = {n: v * masks[n] if n in masks else v for n, v in per_sample_reference(layer, x, g).items()}
    expected_norms = sum(v.flatten(1).pow(2).sum(dim=1) for v in expected.values())
    norms, state = rule.sq_norms(call, g, masks)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-6, atol=1e-12)

    factors = torch.rand(x.shape[0], generator=generator, dtype=torch.float64)
    sums = rule.clipped_sums(call, g, factors, None, masks, state)
    assert set(sums) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(sums[name], torch.einsum("b,b...->...", factors, value), rtol=1e-6, atol=1e-12,
                                   msg=name)
        if name in masks:
            assert bool((sums[name][masks[name] == 0] == 0).all())

    # a sample whose gradient is not finite: factor 0, and it must add exactly nothing
    g_bad = g.clone()
    g_bad[0] = float("nan")
    g_bad.view(g.shape[0], -1)[0, 0] = float("inf")
    _, bad_state = rule.sq_norms(call, g_bad, masks)
    finite = torch.ones(x.shape[0], dtype=torch.bool)
    finite[0] = False
    factors[0] = 0.0
    sums = rule.clipped_sums(call, g_bad, factors, finite, masks, bad_state)
    for name, value in expected.items():
        torch.testing.assert_close(sums[name], torch.einsum("b,b...->...", factors, value), rtol=1e-6, atol=1e-12,
                                   msg=name)
    return state


def seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)  # the layers' initial weights
    return torch.Generator().manual_seed(seed)


def test_every_registered_rule_has_a_case_here() -> None:
    tested = {nn.Linear, nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, nn.Embedding,
              *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())}
    assert set(RULES) == tested


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 4), lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
       width_in=st.integers(1, 10), width_out=st.integers(1, 10), bias=st.booleans(),
       masked=st.sampled_from([(), ("weight",), ("weight", "bias")]))
def test_linear(seed: int, batch: int, lead: list[int], width_in: int, width_out: int, bias: bool,
                masked: tuple[str, ...]) -> None:
    g = seeded(seed)
    x = torch.randn(batch, *lead, width_in, generator=g, dtype=torch.float64)
    check_rule(nn.Linear(width_in, width_out, bias=bias), x, g, masked)


@pytest.mark.parametrize(("tokens", "width_in", "width_out", "grams"), [(2, 8, 8, True), (20, 3, 4, False)])
@pytest.mark.parametrize("masked", [(), ("weight",)])
def test_linear_on_sequences_takes_the_grams_only_when_smaller_and_unmasked(
        tokens: int, width_in: int, width_out: int, grams: bool, masked: tuple[str, ...]) -> None:
    assert use_grams(tokens, width_in, width_out) == grams
    g = seeded(tokens)
    x = torch.randn(3, tokens, width_in, generator=g, dtype=torch.float64)
    state = check_rule(nn.Linear(width_in, width_out), x, g, masked)
    assert state == SEQUENCE  # either way no per-sample gradient is held for the clipped sum


@st.composite
def conv1d_cases(draw: st.DrawFn, lengths: tuple[int, int] | None = None) -> tuple[nn.Conv1d, int]:
    groups = draw(st.sampled_from([1, 2, 3]))
    kernel, stride, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    padding: int | str = draw(st.sampled_from([0, 1, 2, "valid"] + (["same"] if stride == 1 else [])))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    layer = nn.Conv1d(groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2)), kernel, stride=stride,
                      padding=padding, dilation=dilation, groups=groups, bias=draw(st.booleans()), padding_mode=mode)
    return layer, draw(st.integers(*(lengths or (dilation * (kernel - 1) + 3, 12))))


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), case=conv1d_cases(),
       masked=st.sampled_from([(), ("weight",), ("weight", "bias")]))
def test_conv1d(seed: int, batch: int, case: tuple[nn.Conv1d, int], masked: tuple[str, ...]) -> None:
    layer, length = case
    g = seeded(seed)
    check_rule(layer, torch.randn(batch, layer.in_channels, length, generator=g, dtype=torch.float64), g, masked)


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), case=conv1d_cases(lengths=(3 * GROUPED_MIN_POSITIONS + 8,
                                                                                     3 * GROUPED_MIN_POSITIONS + 12)),
       masked=st.sampled_from([(), ("weight",), ("weight", "bias")]))
def test_conv1d_with_many_positions_forms_its_gradients_by_groups(seed: int, batch: int, case: tuple[nn.Conv1d, int],
                                                                  masked: tuple[str, ...]) -> None:
    layer, length = case
    g = seeded(seed)
    x = torch.randn(batch, layer.in_channels, length, generator=g, dtype=torch.float64)
    assert forms_by_groups(layer, layer.double()(x), "weight" in masked)
    check_rule(layer, x, g, masked)


@pytest.mark.parametrize("masked", [(), ("weight",)])
def test_formed_gradients_kept_or_formed_again_give_the_same_sum_bits(masked: tuple[str, ...]) -> None:
    """One backward pass keeps a grouped layer's formed gradients for its sum; two passes form them again: the
    same bits either way, a row that is not finite adding exactly nothing."""
    g = seeded(7)
    layer = nn.Conv1d(4, 6, 3, padding=1, groups=2)
    x = torch.randn(5, 4, GROUPED_MIN_POSITIONS + 40, generator=g)
    out = layer(x)
    grad = torch.randn(out.shape, generator=g)
    grad[2, 0, 0] = float("nan")
    masks = random_masks(layer, g, masked)
    finite = torch.tensor([True, True, False, True, True])
    factors = torch.rand(5, generator=g) * finite
    rule, sums = rule_for(layer), []
    for hold in (True, False):
        call = LayerCall("layer", layer, hold_for_sum=hold)
        call.record(layer, (x,), {}, out)
        _, state = rule.sq_norms(call, grad, masks)
        assert isinstance(state, list) == hold
        sums.append(rule.clipped_sums(call, grad, factors, finite, masks, state))
    assert all(bool(torch.isfinite(v).all()) and torch.equal(v, sums[1][n]) for n, v in sums[0].items())


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
@pytest.mark.parametrize(("height", "width", "grouped"), [(7, 8, False), (20, 30, True)])
def test_conv2d(padding_mode: str, height: int, width: int, grouped: bool) -> None:
    g = seeded(1)
    layer = nn.Conv2d(4, 6, (2, 3), stride=(1, 2), padding=(1, 2), dilation=(2, 1), groups=2,
                      padding_mode=padding_mode)
    x = torch.randn(3, 4, height, width, generator=g, dtype=torch.float64)
    assert forms_by_groups(layer, layer.double()(x), masked=True) == grouped
    check_rule(layer, x, g, ("weight", "bias"))


@pytest.mark.parametrize("hold", [True, False])
def test_off_the_cpu_a_convolutions_sum_contracts_its_patches(hold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU takes (no weight-gradient kernel, whose cuDNN precision nothing pins), run here on the CPU:
    the patches kept from the norms or unfolded again."""
    from dpltm.dp import conv_ghost
    from dpltm.dp.rules import conv as conv_rule

    for module in (conv_ghost, conv_rule):
        monkeypatch.setattr(module, "takes_the_kernel", lambda t: False)
    monkeypatch.setattr(conv_rule, "forms_by_groups", lambda *a: False)
    monkeypatch.setitem(globals(), "LayerCall", functools.partial(LayerCall, hold_for_sum=hold))  # check_rule's
    g = seeded(3)
    layer = nn.Conv2d(4, 6, (2, 3), stride=(1, 2), padding=(1, 2), dilation=(2, 1), groups=2)
    state = check_rule(layer, torch.randn(3, 4, 20, 30, generator=g, dtype=torch.float64), g, ("weight", "bias"))
    assert isinstance(state, torch.Tensor) == hold


@pytest.mark.parametrize(("channels", "grams"), [(256, True), (8, False)])
def test_an_unmasked_convolution_with_many_positions_takes_the_grams_only_when_they_cost_less(
        channels: int, grams: bool) -> None:
    g = seeded(channels)
    layer = nn.Conv1d(channels, channels, 3, padding=1)
    x = torch.randn(2, channels, GROUPED_MIN_POSITIONS + 2, generator=g, dtype=torch.float64)
    assert grams_cost_less(GROUPED_MIN_POSITIONS + 2, 3 * channels, channels) == grams
    assert forms_by_groups(layer, layer.double()(x), masked=False) == (not grams)
    check_rule(layer, x, g)


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), groups=st.sampled_from([1, 2, 4]),
       per_group=st.integers(1, 3), spatial=st.lists(st.integers(1, 5), min_size=0, max_size=2),
       masked=st.sampled_from([(), ("weight",), ("weight", "bias")]))
def test_group_norm(seed: int, batch: int, groups: int, per_group: int, spatial: list[int],
                    masked: tuple[str, ...]) -> None:
    g = seeded(seed)
    layer = nn.GroupNorm(groups, groups * per_group, eps=1e-3)
    with torch.no_grad():  # not the initial ones and zeros: the rule must not depend on the affine values
        layer.weight.normal_(generator=g)
        layer.bias.normal_(generator=g)
    if math.prod(spatial) == 1:  # torch's check (per sample, under torch.func): one value per channel
        spatial = [*spatial, 3]
    x = torch.randn(batch, groups * per_group, *spatial, generator=g, dtype=torch.float64) * 3 + 1
    check_rule(layer, x, g, masked)


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
       shape=st.lists(st.integers(1, 5), min_size=1, max_size=2), bias=st.booleans(),
       masked=st.sampled_from([(), ("weight",), ("weight", "bias")]))
def test_layer_norm(seed: int, batch: int, lead: list[int], shape: list[int], bias: bool,
                    masked: tuple[str, ...]) -> None:
    g = seeded(seed)
    layer = nn.LayerNorm(shape, eps=1e-4, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(generator=g)
    x = torch.randn(batch, *lead, *shape, generator=g, dtype=torch.float64) * 2 - 1
    check_rule(layer, x, g, masked)


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="this torch has no nn.RMSNorm")
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(eps: float | None) -> None:
    g = seeded(2)
    layer = nn.RMSNorm([3, 4], eps=eps)
    check_rule(layer, torch.randn(4, 5, 3, 4, generator=g, dtype=torch.float64), g, ("weight",))


def test_norm_layers_without_affine_parameters_need_no_rule() -> None:
    from dpltm.dp.engine import trainable_layers

    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4, affine=False),
                          nn.LayerNorm(6, elementwise_affine=False), nn.Flatten(), nn.Linear(24, 3))
    assert [name for name, _ in trainable_layers(model)] == ["0", "4"]


@EXAMPLES
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 4), shape=st.lists(st.integers(1, 9), min_size=0, max_size=2),
       vocabulary=st.integers(2, 12), distinct=st.integers(1, 12), width=st.integers(1, 6),
       padding=st.sampled_from([None, 0, -1]), by_frequency=st.booleans(), masked=st.booleans())
def test_embedding(seed: int, batch: int, shape: list[int], vocabulary: int, distinct: int, width: int,
                   padding: int | None, by_frequency: bool, masked: bool) -> None:
    g = seeded(seed)
    layer = nn.Embedding(vocabulary, width, padding_idx=padding, scale_grad_by_freq=by_frequency)
    ids = torch.randint(0, min(distinct, vocabulary), (batch, *shape), generator=g)  # few ids: many repeats
    check_rule(layer, ids, g, ("weight",) if masked else ())


@pytest.mark.parametrize(("tokens", "width"), [(3, 8), (30, 2)])
@pytest.mark.parametrize("masked", [(), ("weight",)])
def test_embedding_takes_either_norm_form(tokens: int, width: int, masked: tuple[str, ...]) -> None:
    g = seeded(tokens)
    assert use_gram(tokens, width) == (tokens < width)
    ids = torch.randint(0, 5, (4, tokens), generator=g)
    ids[0, :2] = 1  # a repeat and the padding id, whichever form
    check_rule(nn.Embedding(6, width, padding_idx=1), ids, g, masked)


@EXAMPLES
@given(batch=st.integers(1, 4), groups=st.integers(1, 3), outputs=st.integers(1, 5), inputs=st.integers(1, 6),
       positions=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_masked_norms_from_position_pairs_equal_the_formed_gradients(batch: int, groups: int, outputs: int,
                                                                     inputs: int, positions: int, seed: int) -> None:
    """The position-pair expansion a masked layer with few positions takes equals ‖(G_i U_iᵀ) ⊙ M‖² of the
    formed gradients, at any number of positions (the rule takes it up to PAIRS_MAX_POSITIONS)."""
    from dpltm.dp.conv_ghost import masked_pair_norms

    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(batch, groups, inputs, positions, generator=g, dtype=torch.float64)
    grads = torch.randn(batch, groups, outputs, positions, generator=g, dtype=torch.float64)
    mask = (torch.rand(groups, outputs, inputs, generator=g) < 0.5).double()
    formed = torch.einsum("bgot,bgkt->bgok", grads, patches) * mask
    torch.testing.assert_close(masked_pair_norms(patches, grads, mask), formed.pow(2).sum(dim=(1, 2, 3)),
                               rtol=1e-9, atol=1e-12)
