"""The DP step's products run in IEEE float32 whatever precision the user's program allowed, and the
user's setting is back afterwards (dpltm.dp.precision)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.dp.precision import _precision_leaves, ieee_float32
from dpltm.networks.lenet import LeNet, build_architecture

NEW_API = bool(_precision_leaves())


def state() -> tuple[str, ...]:
    """What decides float32 products now: the newer API's per-backend settings, else the legacy global."""
    if NEW_API:
        return tuple(leaf.fp32_precision for _, leaf in _precision_leaves())
    return (torch.get_float32_matmul_precision(),)


def ieee() -> tuple[str, ...]:
    return tuple("ieee" for _ in _precision_leaves()) if NEW_API else ("highest",)


def torch_defaults() -> None:
    torch.set_float32_matmul_precision("highest")
    if NEW_API:
        torch.backends.fp32_precision = "none"  # type: ignore[attr-defined]
        for _, leaf in _precision_leaves():
            leaf.fp32_precision = "none"


@pytest.fixture
def user_precision(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The user's program sets a reduced precision its own way; torch's defaults are back after the test."""
    how = request.param
    if how == "legacy-high":
        torch.set_float32_matmul_precision("high")
    elif how == "legacy-medium":
        torch.set_float32_matmul_precision("medium")
    elif how in ("new-tf32", "new-conv-bf16", "new-generic-tf32"):
        if not NEW_API:
            pytest.skip("this torch has no fp32_precision settings")
        if how == "new-tf32":
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        elif how == "new-conv-bf16":
            torch.backends.mkldnn.conv.fp32_precision = "bf16"
        else:
            torch.backends.fp32_precision = "tf32"  # type: ignore[attr-defined]
    yield how
    torch_defaults()


@pytest.mark.parametrize("user_precision", ["default", "legacy-high", "legacy-medium", "new-tf32", "new-conv-bf16",
                                            "new-generic-tf32"], indirect=True)
def test_ieee_inside_and_the_users_setting_after(user_precision: str) -> None:
    before = state()
    with ieee_float32():
        assert state() == ieee()
        if user_precision.startswith("legacy") or user_precision == "default":
            assert torch.get_float32_matmul_precision() == "highest"  # the legacy reading agrees inside
            assert torch.backends.cuda.matmul.allow_tf32 is False
    assert state() == before
    if user_precision.startswith("legacy"):  # the user reads it back the way they set it, without an error
        assert torch.get_float32_matmul_precision() == user_precision.removeprefix("legacy-")
    if user_precision == "new-tf32":
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    if user_precision == "new-conv-bf16":
        assert torch.backends.mkldnn.conv.fp32_precision == "bf16"
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


@pytest.mark.skipif(not NEW_API, reason="this torch has no fp32_precision settings")
@pytest.mark.parametrize("user_precision", ["new-generic-tf32"], indirect=True)
def test_a_setting_inherited_before_is_inherited_after(user_precision: str) -> None:
    """The per-backend getters report the value in effect: writing it back would pin a backend to it, and a
    later change of the general setting would no longer reach it."""
    with ieee_float32():
        pass
    torch.backends.fp32_precision = "ieee"  # type: ignore[attr-defined]
    assert state() == ieee()


def test_the_last_block_to_close_restores_across_threads() -> None:
    """A DP step in a second thread that opens while the first is open, and closes after it, keeps IEEE to its
    end: the first to close leaves the setting alone."""
    import threading

    torch.set_float32_matmul_precision("high")
    try:
        before = state()
        a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
        seen: list[tuple[str, ...]] = []

        def second() -> None:
            a_open.wait(5)
            with ieee_float32():
                b_open.set()
                a_closed.wait(5)
                seen.append(state())

        thread = threading.Thread(target=second)
        thread.start()
        with ieee_float32():
            a_open.set()
            assert b_open.wait(5)  # the second thread's block opened while this one is open
        a_closed.set()
        thread.join(5)
        assert seen == [ieee()]
        assert state() == before
    finally:
        torch_defaults()


@pytest.mark.skipif(not NEW_API, reason="this torch has no fp32_precision settings")
@pytest.mark.parametrize("user_precision", ["new-conv-bf16", "new-generic-tf32"], indirect=True)
def test_a_convolutions_norms_and_clipped_sum_run_in_ieee_float32(user_precision: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a convolution's clipped sum is oneDNN's weight-gradient kernel: pinned with the matrix products."""
    from dpltm.dp import conv_ghost
    from dpltm.dp.engine import clipped_gradient_sum_of
    from dpltm.dp.rules import conv as conv_rule

    seen: list[tuple[str, str, tuple[str, ...]]] = []
    for name in ("clipped_weight_sum", "grouped_grads"):
        def wrapped(*args: object, _run: Any = getattr(conv_ghost, name), _name: str = name) -> Any:
            seen.append((_name, torch.backends.mkldnn.conv.fp32_precision, state()))
            return _run(*args)
        monkeypatch.setattr(conv_ghost, name, wrapped)
        monkeypatch.setattr(conv_rule, name, wrapped)
    # 196 positions (grouped norms, the sum from them), then 36 (patches; the sum by the weight-gradient kernel)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.Flatten(),
                                torch.nn.Linear(144, 5))
    x = torch.randn(4, 2, 16, 16)
    before = state()
    clipped_gradient_sum_of(model, x, torch.randint(0, 5, (4,)), 1.0)
    assert {name for name, _, _ in seen} == {"clipped_weight_sum", "grouped_grads"}
    assert all(conv == "ieee" and inside == ieee() for _, conv, inside in seen)
    assert state() == before
