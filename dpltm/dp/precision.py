"""Full float32 for the products the clipping bound rests on, whatever precision the user's program chose.

A DP step computes each record's masked norm by one product (the ghost norm's Σ_j g_ij² (M a_i²)_j,
dpltm.dp.ghost) and its clipped contribution by another ((c ⊙ G)ᵀ A): the bound ‖contribution‖ ≤ C that the
accountant assumes holds because both are the same arithmetic up to float32 rounding (~1e-7). A program
that allows TF32 or bfloat16 internal precision for float32 matrix products —
`torch.set_float32_matmul_precision("high")`, which Lightning's start-up message on tensor-core GPUs
suggests, or `torch.backends.cuda.matmul.fp32_precision = "tf32"` — rounds each factor to 10 (or 7)
mantissa bits: the norm and the contribution then disagree by up to ~1e-3 relative, and a contribution can
exceed C by that much, so a printed ε would understate what was spent. Inside `ieee_float32()` float32
products run in full precision, and so do oneDNN's float32 convolutions (on the CPU a convolution's clipped sum
is its weight-gradient kernel); the user's setting is restored on leaving. cuDNN's convolution setting (TF32 by
default) is left alone: on a GPU a convolution's norms and clipped sum are products of its unfolded patches, and
the fused MLP step's per-sample gradients are materialised and read by both.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

_LEAVES = (("cuda", "cuda", "matmul"), ("mkldnn", "mkldnn", "matmul"), ("mkldnn", "mkldnn", "conv"))
"""(backend, torch.backends module, operation): cuBLAS's and oneDNN's float32 matrix products, and oneDNN's float32
convolutions (the CPU's clipped sums and grouped norms of a convolution, dpltm.dp.conv_ghost)."""


@functools.cache
def _precision_leaves() -> tuple[tuple[str, Any], ...]:
    """(backend, its settings for one operation) for the newer API's per-backend settings (torch ≥ 2.9:
    `fp32_precision`), or none on an older torch. Looked up once: torch's modules do not change."""
    leaves = ((backend, getattr(getattr(torch.backends, module, None), op, None)) for backend, module, op in _LEAVES)
    return tuple((backend, leaf) for backend, leaf in leaves if hasattr(leaf, "fp32_precision"))


def _own_setting(backend: str, leaf: Any) -> str:
    """What a per-backend matmul or convolution setting holds itself: its value, or "none" where it only repeats what it
    inherits (the getter reports the value in effect; writing that back would pin it, cutting it off from a
    later change of the backend-wide or general setting)."""
    value = leaf.fp32_precision
    try:
        inherited = torch._C._get_fp32_precision_getter(backend, "all")
    except (AttributeError, RuntimeError, TypeError):
        return str(value)
    return "none" if value == inherited else str(value)


def _legacy() -> str | None:
    """The legacy setting (`set_float32_matmul_precision`), None where reading it raises (torch refuses once
    the newer API has set something it cannot express)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


_lock = threading.Lock()
_depth = 0
_saved: tuple[str | None, list[str]] | None = None


def _enter() -> None:
    global _depth, _saved
    with _lock:
        _depth += 1
        if _depth > 1:  # a block already open (nested, or a step in another thread): it restores at the end
            return
        leaves = _precision_leaves()
        legacy = _legacy()
        _saved = (legacy, [_own_setting(backend, leaf) for backend, leaf in leaves])
        if legacy is not None and legacy != "highest":
            torch.set_float32_matmul_precision("highest")  # keeps the legacy reading consistent inside
        for _, leaf in leaves:
            leaf.fp32_precision = "ieee"


def _exit() -> None:
    global _depth, _saved
    with _lock:
        _depth -= 1
        if _depth > 0 or _saved is None:
            return
        legacy, own = _saved
        _saved = None
        if legacy is not None and legacy != "highest":
            torch.set_float32_matmul_precision(legacy)
        for (_, leaf), value in zip(_precision_leaves(), own, strict=True):
            leaf.fp32_precision = value


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matrix products in IEEE float32 inside the block (no TF32, no bfloat16 passes); usable as a
    decorator (of a plain function: a generator's body would run after the block). The first block to open
    saves the program's setting and the last to close restores it, across threads; a setting another thread
    makes while a block is open is overwritten then. Costs a few microseconds on the host, nothing on the
    device."""
    _enter()
    try:
        yield
    finally:
        _exit()
