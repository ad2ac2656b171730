"""Augmentation multiplicity's views of a record: K fixed shifts of a square image (De et al. 2022, §3).

De et al. ("Unlocking High-Accuracy Differentially Private Image Classification through Scale", 2022, §3)
average each record's gradient over K augmented views *before* clipping: the mean is still a function of one
record, so its clipped contribution has norm ≤ C and the sensitivity, the Poisson sampling over records and
the accountant's event are those of plain DP-SGD. Here a view is the image moved by a small offset with zero
fill (the images are grey levels on a black background, 0 after the 1/255 scaling); view 0 is the image itself,
what evaluation and prediction read.

The views are a fixed list, the same at every step, rather than fresh random shifts per step: a fixed front end
(the ScatterNet's scattering transform) then computes each view's features once and caches them like the
image's (dpltm.feature_cache), where random shifts would cost the transform at every step. The list runs
through the one-pixel shifts first (the four axis-aligned ones, then the diagonals), then the two-pixel ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dpltm.errors import DpltmUserError

VIEW_OFFSETS: tuple[tuple[int, int], ...] = (
    (0, 0), (0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1),
    (0, 2), (0, -2), (2, 0), (-2, 0), (2, 2), (-2, -2), (2, -2),
)
"""(rows down, columns right) of each view, view 0 the image itself."""

MAX_AUGMULT = len(VIEW_OFFSETS)
"""The most views per record (`train.augmult`)."""

MAX_SHIFT = max(max(abs(dy), abs(dx)) for dy, dx in VIEW_OFFSETS)


def shifted(records: Tensor, offset: tuple[int, int]) -> Tensor:
    """Each row of `records` (N, side²), a square image, moved by `offset` (rows, columns) with zero fill."""
    dy, dx = offset
    if (dy, dx) == (0, 0):
        return records
    side = math.isqrt(records.shape[1])
    images = records.reshape(-1, 1, side, side)
    p = MAX_SHIFT
    padded = F.pad(images, (p, p, p, p))
    return padded[:, :, p - dy: p - dy + side, p - dx: p - dx + side].reshape(records.shape[0], -1).contiguous()


def view_stack(records: Tensor, views: int) -> Tensor:
    """(N, K, side²): every record's first K views (`VIEW_OFFSETS`), view 0 the record itself."""
    return torch.stack([shifted(records, offset) for offset in VIEW_OFFSETS[:views]], dim=1)


def check_takes_views(model: torch.nn.Module, width: int, views: int) -> None:
    """Refuse, in one line, a network that cannot read a record's K views as (B, K, width): only a chain of
    linear layers applies itself to every view alike (--arch mlp, and the ScatterNet's linear and MLP heads over
    their features); a convolution takes one image per row. The records must be square images, to be shifted."""
    arch = getattr(model, "arch", None)
    fully_connected = bool(getattr(model, "fully_connected", False)) or bool(getattr(arch, "is_mlp", False))
    if not fully_connected:
        name = getattr(arch, "name", None) or "lenet5"
        raise DpltmUserError(f"--augmult {views} averages a record's views through fully connected layers (--arch mlp,"
                             f" scatter-linear, scatter-mlp); --arch {name} takes one image per record: drop --augmult")
    side = math.isqrt(width)
    if side * side != width:
        raise DpltmUserError(f"--augmult {views} shifts square images; these records of {width} values are not")
