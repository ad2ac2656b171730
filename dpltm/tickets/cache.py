"""Public tickets are public artefacts: `dpltm run` keeps each ticket set it made on public data in the
user's cache, like torchvision keeps downloaded weights, so a second run with the same settings on the
same public data skips the generation.

A cached set is keyed by its generation settings' hash (`config.config_hash`, what a resumed `generate`
checks) and the public data's fingerprint (the ticket set stores both), and is used only when it is
complete and both match. Generation is deterministic for a seed, so a cache hit gives the tickets the
generation would have made. Only sets made on *public* data go here (`dpltm run` takes its tickets from
the public dataset by construction): a set made on private data would be private data.
The folder is `$DPLTM_TICKET_CACHE`, else ``~/.cache/dpltm/tickets``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from dpltm.checkpoint import load_ticket_set
from dpltm.config import config_hash
from dpltm.errors import DpltmUserError
from dpltm.outputs import write_bytes_atomic
from dpltm.paths import user_cache_dir
from dpltm.settings import GenerateConfig

TICKET_CACHE_ENV = "DPLTM_TICKET_CACHE"


def ticket_cache_dir() -> Path:
    return user_cache_dir("tickets", TICKET_CACHE_ENV)


def cached_tickets(cfg: GenerateConfig, fingerprint: str) -> Path:
    """Where the complete ticket set of these settings on this public data is kept."""
    return ticket_cache_dir() / f"{cfg.data.dataset}-{config_hash(cfg)}-{fingerprint[:16]}.pt"


def restore_tickets(cfg: GenerateConfig, fingerprint: str, target: Path) -> Path | None:
    """Copy the cached set to `target` (atomically) when there is a complete one for these settings and this
    data; returns the cached file, or None (none, or one that does not check out: it is then ignored)."""
    cached = cached_tickets(cfg, fingerprint)
    if not cached.is_file():
        return None
    try:
        tickets = load_ticket_set(cached)
    except DpltmUserError as exc:
        print(f"ticket cache {cached} is not usable ({exc}): generating the tickets", file=sys.stderr)
        return None
    if not tickets.complete or tickets.config_hash != config_hash(cfg) or tickets.fingerprint != fingerprint:
        return None
    write_bytes_atomic(cached.read_bytes(), target)
    return cached


def keep_tickets(cfg: GenerateConfig, fingerprint: str, made: Path) -> None:
    """Keep a complete public ticket set for later runs; a cache that cannot be written is skipped."""
    cached = cached_tickets(cfg, fingerprint)
    temporary = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made, temporary)
        os.replace(temporary, cached)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        print(f"ticket cache not written ({cached.parent}: {exc.strerror})", file=sys.stderr)
