"""Fault switches for the tests (never in the library): break the mechanism on purpose, so the
tests can show the audit notices.

Each fault patches the one function of the real training path it breaks, for the duration of a
`with` block; nothing in the CLI or the library's API can turn one on. The audit must then report
a lower bound above the claimed ε (the claim no longer describes what ran):

- `no-noise`: the Gaussian noise is not added (`add_gaussian_all` returns its input);
- `no-clipping`: every clip factor is 1 (per-sample gradients enter the sum at full norm);
- `noise-on-pruned`: the noise goes to the pruned coordinates instead of the surviving ones
  (for a dense network, whose every coordinate survives, that is no noise at all).

The noise faults break the eager step's `add_gaussian_all`, which audits run; the static (CUDA-graph) step draws
its noise itself (`StaticShapeDpStep._flat_update`) and is not broken by them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch import Tensor

FAULTS = ("no-noise", "no-clipping", "noise-on-pruned")


def _pruned(surviving: Tensor | None, numel: int) -> Tensor:
    keep = torch.ones(numel, dtype=torch.bool, device=None if surviving is None else surviving.device)
    if surviving is not None:
        keep[surviving] = False
    else:
        keep[:] = False
    return torch.nonzero(keep).squeeze(1)


@contextlib.contextmanager
def fault(kind: str) -> Iterator[None]:
    """Run the block with the mechanism broken in the named way (see FAULTS)."""
    from dpltm.dp import ghost, mechanism

    if kind == "no-noise":
        with mock.patch.object(mechanism, "add_gaussian_all",
                               lambda sums, surviving, std, generator, scales=None: sums):
            yield
    elif kind == "no-clipping":
        def unclipped(norms: Tensor, clip: float, row_clips: Tensor | None = None,
                      zero_non_finite: bool = True) -> Tensor:  # a padding row (C_i = 0) still adds nothing
            return torch.ones_like(norms) if row_clips is None else (row_clips > 0).to(norms.dtype)

        with mock.patch.object(ghost, "clip_factors", unclipped):
            yield
    elif kind == "noise-on-pruned":
        real = mechanism.add_gaussian_all

        def misplaced(sums: dict[str, Tensor], surviving: dict[str, Tensor | None], std: float,
                      generator: torch.Generator, scales: dict[str, Tensor | None] | None = None) -> dict[str, Tensor]:
            wrong = {name: _pruned(surviving.get(name), total.numel()).to(total.device) for name, total in sums.items()}
            noised = {name: total for name, total in sums.items() if wrong[name].numel()}
            return {**sums, **real(noised, wrong, std, generator, None)}

        with mock.patch.object(mechanism, "add_gaussian_all", misplaced):
            yield
    else:
        raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULTS)}")
