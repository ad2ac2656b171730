"""Seeded, stratified splits: every class gives up the same fraction of its rows.

Randomness comes only from explicitly seeded `torch.Generator`s, never a global RNG, so a
(seed, labels) pair always yields the same split on any machine.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor


def derive_seed(seed: int, purpose: str) -> int:
    """An independent seed per purpose ("test", "val"), so the two splits never correlate."""
    digest = hashlib.sha256(f"dpltm:{purpose}:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def class_quotas(counts: np.ndarray, fraction: float, generator: torch.Generator) -> np.ndarray:
    """Rows each class gives up: within 1 of fraction x count, summing to round(fraction x N).

    Largest-remainder apportionment; ties between equal remainders are broken at random so
    that no class is always the one rounded up.
    """
    exact = counts.astype(np.float64) * fraction
    quotas = np.floor(exact).astype(np.int64)
    total = int(np.floor(exact.sum() + 0.5))
    extra = total - int(quotas.sum())
    tiebreak = torch.rand(len(counts), generator=generator, dtype=torch.float64).numpy()
    order = np.lexsort((tiebreak, -(exact - quotas)))
    quotas[order[:extra]] += 1
    return np.minimum(quotas, counts)


def stratified_split(
    labels: np.ndarray | Tensor, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (kept, held_out), each sorted, holding out `fraction` of every class.

    The two parts partition range(len(labels)); original order is kept within each part.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    if isinstance(labels, Tensor):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels).reshape(-1)
    generator = torch.Generator().manual_seed(int(seed))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    quotas = class_quotas(counts, fraction, generator)
    by_class = np.argsort(inverse.reshape(-1), kind="stable")
    starts = np.cumsum(counts) - counts
    held = [
        by_class[start + torch.randperm(int(count), generator=generator).numpy()[:quota]]
        for start, count, quota in zip(starts, counts, quotas, strict=True)
    ]
    held_out = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    keep = np.ones(labels.shape[0], dtype=bool)
    keep[held_out] = False
    return np.flatnonzero(keep).astype(np.int64), held_out.astype(np.int64)
