"""Where data and outputs live. All path decisions are made here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path

from dpltm.errors import DpltmUserError

DATA_DIR_ENV = "DPLTM_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def default_data_dirs() -> list[Path]:
    """Candidates for `../shared/data`, relative to the working directory and to the checkout."""
    return [Path.cwd().parent / "shared" / "data", _REPO_ROOT.parent / "shared" / "data"]


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """The data root: the explicit option, then $DPLTM_DATA_DIR, then ../shared/data if it exists."""
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        source = "--data-dir"
    elif os.environ.get(DATA_DIR_ENV):
        root = Path(os.environ[DATA_DIR_ENV]).expanduser()
        source = f"${DATA_DIR_ENV}"
    else:
        for candidate in default_data_dirs():
            if candidate.is_dir():
                return candidate
        raise DpltmUserError(
            f"no data directory: pass --data-dir or set ${DATA_DIR_ENV} "
            f"(the default ../shared/data does not exist)"
        )
    if not root.is_dir():
        raise DpltmUserError(f"data directory {root} (from {source}) does not exist")
    return root


def default_checkpoint_dir() -> Path:
    """Outputs go to ./checkpoints unless the user says otherwise."""
    return Path("checkpoints")
