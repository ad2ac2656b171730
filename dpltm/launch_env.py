"""The ranks a launcher (torchrun, SLURM, Lightning) states in the environment, checked at start.

Lightning parses $RANK and friends when it is imported, so a malformed one (`RANK=abc`) would be
a traceback from deep inside an import: the CLI checks them first, without importing torch.
"""

from __future__ import annotations

import os

from dpltm.errors import DpltmUserError

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "SLURM_PROCID", "SLURM_LOCALID",
                  "SLURM_NODEID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS")


def env_rank(name: str) -> int:
    """A whole number ≥ 0 the launcher set in `name` (0 when unset), or a one-line error."""
    text = os.environ.get(name, "0")
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if rank < 0:
        raise DpltmUserError(f"${name}={text[:40]!r} is not a whole number ≥ 0: unset it, or let the launcher set it")
    return rank


def check_rank_environment() -> None:
    """Every rank variable that is set must be a whole number ≥ 0."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            env_rank(name)
