"""Features of a fixed front end (dpltm.networks.scatter), computed once per record and cached.

A front end such as the scattering transform is a deterministic function of one record and of its
own settings, so its features can be computed once and reused by every stage and every later run:
`network_inputs(model, data)` gives the splits as the model's head reads them.

The cache is **private data** when the records are: features are a function of the records. It
lives in the user's own cache folder (`$DPLTM_FEATURE_CACHE`, else ``~/.cache/dpltm/features``,
made with mode 0700, files 0600), never in a checkpoint, model file or export (those hold the head's
weights only: the front end has no state). A cache file is keyed by a SHA-256 of the records' exact
bytes and the front end's settings (`ScatterFront.settings`): other data or other settings name
another file, so a stale entry is never found. Each file stores a SHA-256 of its own features (over
32 MiB pieces hashed in parallel) and is checked when read; a damaged, truncated or foreign file is
reported on stderr and rebuilt, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.dp.distributed import available_cores
from dpltm.errors import DpltmUserError
from dpltm.paths import user_cache_dir

CACHE_ENV = "DPLTM_FEATURE_CACHE"
CACHE_FORMAT = 2
"""2: the checksum is a SHA-256 over 32 MiB pieces (`_checksum`); a format-1 file is rebuilt."""
CHECKSUM_PIECE = 32 << 20
CHUNK = 1024
"""Records per front-end call: bounds the transform's working memory."""


def feature_cache_dir() -> Path:
    """Where cached features live: `$DPLTM_FEATURE_CACHE`, else the user's ``~/.cache/dpltm/features``."""
    return user_cache_dir("features", CACHE_ENV)


def front_of(model: torch.nn.Module) -> Any | None:
    """The model's fixed front end (an object with `settings()`, `in_features`, `out_features`), or None."""
    front = getattr(model, "front", None)
    return front if front is not None and callable(getattr(front, "settings", None)) else None


def network_inputs(model: torch.nn.Module, data: DatasetSplits, *, progress: bool = False,
                   cache_dir: Path | None = None) -> DatasetSplits:
    """`data` as `model`'s head reads it: each split's records replaced by their cached front-end features
    (unchanged for a network without a front end, or for splits that already hold features). Labels,
    names, sizes and the fingerprint stay the records'."""
    front = front_of(model)
    if front is None:
        return data
    folder = feature_cache_dir() if cache_dir is None else cache_dir
    parts = {}
    for name in ("train", "val", "test"):
        split: LabeledTensors = getattr(data, name)
        parts[name] = LabeledTensors(features_of(front, split.features, folder, progress=progress,
                                                 label=f"{data.name} {name}"), split.labels)
    return replace(data, **parts)


def features_of(front: Any, records: Tensor, folder: Path, *, progress: bool = False, label: str = "") -> Tensor:
    """The front end's features of `records` (N, in_features), from the cache or computed and cached."""
    width = records.shape[1] if records.dim() == 2 else -1
    if width == front.out_features:
        return records
    if width != front.in_features:
        raise DpltmUserError(f"the front end takes records of {front.in_features} values, got shape "
                             f"{tuple(records.shape)}")
    if records.shape[0] == 0:
        return records.new_zeros(0, front.out_features)
    key = cache_key(front.settings(), records)
    path = folder / f"{key}.pt"
    features = _recent.pop(key, None)
    if features is None:
        features = read_cached(path, key, (records.shape[0], front.out_features))
    if features is None:
        features = compute_features(front, records, progress=progress, label=label)
        write_cached(path, key, front.settings(), features)
    _recent[key] = features  # most recent last
    while len(_recent) > RECENT:
        _recent.popitem(last=False)
    return features.to(device=records.device, dtype=records.dtype)


_recent: OrderedDict[str, Tensor] = OrderedDict()
"""Splits this process read or computed last, by cache key: the stages of one `dpltm run` and the runs of
a grid read each split's file (and check its checksum) once."""
RECENT = 6


def cache_key(settings: dict[str, Any], records: Tensor) -> str:
    """SHA-256 of the front end's settings and the records' exact values (float32, row-major)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(repr(tuple(records.shape)).encode())
    digest.update(_bytes(records))
    return digest.hexdigest()


def _bytes(values: Tensor) -> memoryview:
    array: np.ndarray = values.detach().to("cpu", torch.float32).contiguous().numpy()
    return memoryview(array).cast("B")


def _checksum(features: Tensor) -> str:
    """SHA-256 over the SHA-256s of the features' 32 MiB pieces, hashed in parallel threads (hashlib
    releases the GIL): a file of a gigabyte is checked at the speed of all the cores, not of one."""
    data = _bytes(features)
    starts = range(0, len(data), CHECKSUM_PIECE)

    def piece(start: int) -> bytes:
        return hashlib.sha256(data[start:start + CHECKSUM_PIECE]).digest()

    workers = min(len(starts), available_cores())
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            digests = list(pool.map(piece, starts))
    else:
        digests = [piece(start) for start in starts]
    return hashlib.sha256(f"dpltm-feature-pieces:{CHECKSUM_PIECE}:".encode() + b"".join(digests)).hexdigest()


@torch.no_grad()
def compute_features(front: Any, records: Tensor, *, progress: bool = False, label: str = "") -> Tensor:
    """The front end over `records` in chunks, on the records' device; float32 on the CPU. Each
    record's features depend on that record alone (the transform and its normalisation are per record)."""
    from dpltm.progress import step_bar

    out = torch.empty(records.shape[0], front.out_features, dtype=torch.float32)
    with step_bar(f"features {label}".strip(), records.shape[0], enabled=progress) as bar:
        for start in range(0, records.shape[0], CHUNK):
            chunk = records[start:start + CHUNK]
            out[start:start + chunk.shape[0]] = front(chunk).to("cpu", torch.float32)
            bar.update(chunk.shape[0])
    return out


def read_cached(path: Path, key: str, shape: tuple[int, int]) -> Tensor | None:
    """The cached features at `path` if the file is whole and is the one for `key`; None if there is
    none; a damaged or foreign file is reported on stderr and left to be rebuilt."""
    if not path.exists():
        return None
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
        problem = _problem(body, key, shape)
    except Exception as exc:  # any unreadable file is rebuilt, never trusted
        problem = f"unreadable ({type(exc).__name__})"
    if problem is None:
        return body["features"]  # type: ignore[no-any-return]
    if problem == EARLIER_FORMAT:
        print(f"feature cache {path} was written by an earlier dpltm: computing the features again",
              file=sys.stderr)
    else:
        print(f"feature cache {path} is damaged ({problem}): computing the features again", file=sys.stderr)
    return None


EARLIER_FORMAT = "an earlier format"


def _problem(body: Any, key: str, shape: tuple[int, int]) -> str | None:
    if isinstance(body, dict) and type(body.get("format")) is int and 0 < body["format"] < CACHE_FORMAT:
        return EARLIER_FORMAT
    if not isinstance(body, dict) or body.get("format") != CACHE_FORMAT:
        return "not a dpltm feature cache"
    if body.get("key") != key:
        return "made for other records or settings"
    features = body.get("features")
    if not isinstance(features, Tensor) or tuple(features.shape) != shape or features.dtype != torch.float32:
        return "features of the wrong shape or type"
    if body.get("sha256") != _checksum(features):
        return "checksum mismatch"
    return None


_UNWRITABLE: set[str] = set()
"""Cache folders this process could not create or write in (said once each)."""


def write_cached(path: Path, key: str, settings: dict[str, Any], features: Tensor) -> None:
    """Write a cache file atomically (temp file, fsync, rename), readable by the user alone. A cache that
    cannot be written is skipped with a note: the run goes on with the features it computed."""
    body = {"format": CACHE_FORMAT, "key": key, "settings": settings, "sha256": _checksum(features),
            "features": features}
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    except OSError as exc:
        if str(path.parent) not in _UNWRITABLE:  # once a folder per run, not once a split
            _UNWRITABLE.add(str(path.parent))
            print(f"feature cache not written ({path.parent}: {exc.strerror}); the features are not kept",
                  file=sys.stderr)
        return
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(body, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        print(f"feature cache not written ({path}: {exc.strerror}); the features are not kept", file=sys.stderr)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
