"""Checkpoint files: written atomically, read with `weights_only=True`, versioned.

A file is a dict of tensors and plain values (no pickled classes), so `torch.load` can read
it without executing code. Writing goes to a temporary file in the same directory that is
fsynced and then `os.replace`d over the target: a crash leaves either the old file or the new
one, never half of one (open_lth's plain `torch.save` does not).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dpltm.errors import DpltmUserError

FORMAT_VERSION = 1
KINDS = ("tickets", "ticket", "model")
"""tickets: a generated ticket set; ticket: one selected winner; model: a trained network."""


def check_writable(path: Path) -> None:
    """Fail before any work is done if the output cannot be written."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.exists() and path.is_dir():
        raise DpltmUserError(f"output {path} is a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DpltmUserError(f"cannot create output directory {parent}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise DpltmUserError(f"output directory {parent} is not writable")


def save_atomic(payload: dict[str, Any], path: Path, kind: str) -> None:
    """Write `payload` (plus format header) to `path` atomically."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind}")
    check_writable(path)
    body = {"format": "dpltm", "kind": kind, "format_version": FORMAT_VERSION, **payload}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(body, handle)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_checkpoint(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """Read a dpltm checkpoint of the expected kind(s), or explain in one line why not."""
    kinds = (kind,) if isinstance(kind, str) else kind
    if not path.exists():
        raise DpltmUserError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise DpltmUserError(f"checkpoint {path} is a directory, not a file")
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for foreign or damaged files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"{path} is not a readable dpltm checkpoint ({first[:120]})") from None
    if not isinstance(body, dict) or body.get("format") != "dpltm":
        raise DpltmUserError(f"{path} is not a dpltm checkpoint")
    if body.get("format_version") != FORMAT_VERSION:
        raise DpltmUserError(
            f"{path} has checkpoint format {body.get('format_version')}, "
            f"this dpltm reads format {FORMAT_VERSION}"
        )
    if body.get("kind") not in kinds:
        raise DpltmUserError(
            f"{path} holds a '{body.get('kind')}' checkpoint, expected {' or '.join(kinds)}"
        )
    return body
