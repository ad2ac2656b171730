"""Magnitude pruning: exact fractions, nested masks, smallest survivors removed."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from dpltm.errors import DpltmUserError
from dpltm.pruning import paper_prune_rates, prune_layerwise, random_masks_like


@st.composite
def layer_case(draw):  # type: ignore[no-untyped-def]
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(rows, cols, generator=g)
    if draw(st.booleans()):  # ties: quantised magnitudes
        weights = torch.round(weights * 2) / 2
    mask = torch.rand(rows, cols, generator=g) < draw(st.floats(0.2, 1.0))
    rate = draw(st.floats(0.01, 0.99))
    return weights, mask, rate


@settings(max_examples=200, deadline=None)
@given(layer_case())
def test_prune_properties(case) -> None:  # type: ignore[no-untyped-def]
    weights, mask, rate = case
    new = prune_layerwise({"w": weights}, {"w": mask}, {"w": rate})["w"]
    survivors = int(mask.sum())
    # exact count removed: ceil(rate × survivors)
    assert survivors - int(new.sum()) == min(survivors, math.ceil(rate * survivors))
    # new mask inside the old one
    assert not bool((new & ~mask).any())
    # the removed weights are the smallest survivors: one threshold splits them
    removed = weights.abs()[mask & ~new]
    kept = weights.abs()[new]
    if removed.numel() and kept.numel():
        assert removed.max() <= kept.min()


def test_layerwise_rates_are_per_layer() -> None:
    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(30, 10, generator=g), "b": torch.randn(10, 10, generator=g)}
    masks = {k: torch.ones_like(v, dtype=torch.bool) for k, v in weights.items()}
    new = prune_layerwise(weights, masks, {"a": 0.3, "b": 0.2})
    assert int(new["a"].sum()) == 300 - 90
    assert int(new["b"].sum()) == 100 - 20


def test_pruned_weights_are_never_chosen_again() -> None:
    # Pruned positions hold the smallest raw values; they must not count as survivors.
    weights = {"w": torch.tensor([[0.0, 0.0, 5.0, 6.0, 7.0, 8.0]])}
    mask = {"w": torch.tensor([[False, False, True, True, True, True]])}
    new = prune_layerwise(weights, mask, {"w": 0.5})["w"]
    assert new.tolist() == [[False, False, False, False, True, True]]


def test_paper_rates() -> None:
    rates = paper_prune_rates(["hidden.0.weight", "hidden.1.weight", "output.weight"])
    assert rates == {"hidden.0.weight": 0.3, "hidden.1.weight": 0.3, "output.weight": 0.2}


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 1.5])
def test_rates_outside_open_interval_are_refused(rate: float) -> None:
    with pytest.raises(DpltmUserError, match="prune rate"):
        prune_layerwise({"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2, dtype=torch.bool)}, {"w": rate})


def test_random_mask_keeps_each_layers_density() -> None:
    g = torch.Generator().manual_seed(0)
    masks = {"a": torch.rand(20, 30, generator=g) < 0.3, "b": torch.rand(5, 5, generator=g) < 0.7}
    rand = random_masks_like(masks, torch.Generator().manual_seed(1))
    for k in masks:
        assert int(rand[k].sum()) == int(masks[k].sum())
    assert not torch.equal(rand["a"], masks["a"])
