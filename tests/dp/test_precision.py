"""The DP step's products run in IEEE float32 whatever precision the user's program allowed, and the
user's setting is back afterwards (dpltm.dp.precision)."""

from __future__ import annotations

import pytest
import torch

from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.dp.precision import _precision_leaves, ieee_float32
from dpltm.model import LeNet, build_architecture

NEW_API = bool(_precision_leaves())


def state() -> tuple[str, ...]:
    """What decides float32 products now: the newer API's per-backend settings, else the legacy global."""
    if NEW_API:
        return tuple(leaf.fp32_precision for leaf in _precision_leaves())
    return (torch.get_float32_matmul_precision(),)


def ieee() -> tuple[str, ...]:
    return tuple("ieee" for _ in _precision_leaves()) if NEW_API else ("highest",)


@pytest.fixture
def user_precision(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The user's program sets a reduced precision its own way; everything is put back after the test."""
    legacy = torch.get_float32_matmul_precision()
    saved = [leaf.fp32_precision for leaf in _precision_leaves()]
    how = request.param
    if how == "legacy-high":
        torch.set_float32_matmul_precision("high")
    elif how == "legacy-medium":
        torch.set_float32_matmul_precision("medium")
    elif how == "new-tf32":
        if not NEW_API:
            pytest.skip("this torch has no fp32_precision settings")
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    yield how
    for leaf, value in zip(_precision_leaves(), saved, strict=True):
        leaf.fp32_precision = value
    if not NEW_API or how.startswith("legacy") or how == "default":
        torch.set_float32_matmul_precision(legacy)


@pytest.mark.parametrize("user_precision", ["default", "legacy-high", "legacy-medium", "new-tf32"], indirect=True)
def test_ieee_inside_and_the_users_setting_after(user_precision: str) -> None:
    before = state()
    with ieee_float32():
        assert state() == ieee()
    assert state() == before
    if user_precision.startswith("legacy"):  # the user reads it back the way they set it, without an error
        assert torch.get_float32_matmul_precision() == user_precision.removeprefix("legacy-")
    if user_precision == "new-tf32":
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    with pytest.raises(ValueError), ieee_float32():  # restored on the way out of an error too
        raise ValueError
    assert state() == before


@pytest.mark.parametrize("user_precision", ["legacy-high", "new-tf32"], indirect=True)
def test_the_norms_and_the_clipped_sum_run_in_ieee_float32(user_precision: str) -> None:
    model = LeNet(build_architecture(12, 5, (10,), None), torch.Generator().manual_seed(0))
    seen: list[tuple[str, ...]] = []
    activation = model.activation
    model.activation = lambda z: (seen.append(state()), activation(z))[1]  # type: ignore[method-assign]
    masks = model.full_masks()
    layout = MaskLayout.of(model, masks)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    before = state()
    clipped_gradient_sum(model, x, y, 1.0, layout)
    assert seen and all(s == ieee() for s in seen)
    assert state() == before
    first_layer_input_terms(x, layout)
    assert state() == before
