"""Full float32 for the products the clipping bound rests on, whatever precision the user's program chose.

A DP step computes each record's masked norm by one product (the ghost norm's Σ_j g_ij² (M a_i²)_j,
dpltm.dp.ghost) and its clipped contribution by another ((c ⊙ G)ᵀ A): the bound ‖contribution‖ ≤ C that the
accountant assumes holds because both are the same arithmetic up to float32 rounding (~1e-7). A program
that allows TF32 or bfloat16 internal precision for float32 matrix products —
`torch.set_float32_matmul_precision("high")`, which Lightning's start-up message on tensor-core GPUs
suggests, or `torch.backends.cuda.matmul.fp32_precision = "tf32"` — rounds each factor to 10 (or 7)
mantissa bits: the norm and the contribution then disagree by up to ~1e-3 relative, and a contribution can
exceed C by that much, so a printed ε would understate what was spent. Inside `ieee_float32()` float32
products run in full precision; the user's setting is restored on leaving. Convolutions' cuDNN TF32 setting
is left alone: a convolution's per-sample gradients are materialised (dpltm.dp.rules.conv2d_weight_grads)
and their norms and sum read the same tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _precision_leaves() -> list[Any]:
    """The per-backend settings of the newer API (torch ≥ 2.9: `fp32_precision` on cuBLAS's and oneDNN's
    matmul), or none on an older torch. Reading the legacy flags after the newer API was used raises, so a
    torch that has the newer API is only ever asked through it."""
    leaves = []
    for backend in (getattr(torch.backends, "cuda", None), getattr(torch.backends, "mkldnn", None)):
        matmul = getattr(backend, "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            leaves.append(matmul)
    return leaves


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matrix products in IEEE float32 inside the block (no TF32, no bfloat16 passes); usable as a
    decorator. Costs a few attribute reads and writes on the host, nothing on the device."""
    leaves = _precision_leaves()
    if leaves:
        saved = [leaf.fp32_precision for leaf in leaves]
        if all(value == "ieee" for value in saved):
            yield
            return
        for leaf in leaves:
            leaf.fp32_precision = "ieee"
        try:
            yield
        finally:
            for leaf, value in zip(leaves, saved, strict=True):
                leaf.fp32_precision = value
        return
    legacy = torch.get_float32_matmul_precision()
    if legacy == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy)
