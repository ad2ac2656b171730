"""Features of a fixed front end (dpltm.networks.scatter), computed once per record and cached.

A front end such as the scattering transform is a deterministic function of one record and of its
own settings, so its features can be computed once and reused by every stage and every later run:
`network_inputs(model, data)` gives the splits as the model's head reads them.

The cache is **private data** when the records are: features are a function of the records. It
lives in the user's own cache folder (`$DPLTM_FEATURE_CACHE`, else ``~/.cache/dpltm/features``,
made with mode 0700, files 0600), never in a checkpoint, model file or export (those hold the head's
weights only: the front end has no state). An existing folder open to other users, or not the user's,
is not used (`cache_secret`). A cache file is named by a SHA-256 of the records' exact bytes and the
front end's settings (`ScatterFront.settings`): other data or other settings name another file, so a
stale entry is never found. Each file stores an HMAC-SHA-256 of its own features (over 32 MiB pieces
hashed in parallel) keyed by a secret kept in the folder (`KEY_FILE`, 0600), checked when read: a
damaged, truncated or foreign file, or one made by anyone without the key, is reported on stderr and
rebuilt, never used. Entries are opened only as regular files: a pipe in their place cannot block a run.
The cache is best effort: whatever keeps it from being read or written is one note on stderr, and the
run goes on computing the features.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import tempfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.data.views import VIEW_OFFSETS, check_takes_views, shifted, view_stack
from dpltm.dp.distributed import available_cores
from dpltm.errors import DpltmUserError, os_error_behind, raise_if_stopping
from dpltm.paths import user_cache_dir

CACHE_ENV = "DPLTM_FEATURE_CACHE"
CACHE_FORMAT = 3
"""3: the checksum is an HMAC keyed by the folder's secret (`_checksum`); a file of an earlier format is rebuilt."""
KEY_FILE = ".hmac-key"
KEY_BYTES = 32
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
                   cache_dir: Path | None = None, views: int = 1) -> DatasetSplits:
    """`data` as `model`'s head reads it: each split's records replaced by their cached front-end features
    (unchanged for a network without a front end, or for splits that already hold features). Labels,
    names, sizes and the fingerprint stay the records'.

    `views` K > 1 (augmentation multiplicity, dpltm.data.views): the training split becomes (N, K, width), each
    record's K shifted views as the head reads them, each view's features computed once and cached under a key
    that names the view; validation and test keep view 0, the records themselves."""
    if views > 1:
        check_takes_views(model, data.train.features.shape[-1], views)
    front = front_of(model)
    if front is None:
        if views == 1:
            return data
        return replace(data, train=LabeledTensors(view_stack(data.train.features, views), data.train.labels))
    folder = feature_cache_dir() if cache_dir is None else cache_dir
    parts = {}
    for name in ("train", "val", "test"):
        split: LabeledTensors = getattr(data, name)
        label = f"{data.name} {name}"
        if name == "train" and views > 1:
            features = _view_features(front, split.features, views, folder, progress=progress, label=label)
        else:
            features = features_of(front, split.features, folder, progress=progress, label=label)
        parts[name] = LabeledTensors(features, split.labels)
    return replace(data, **parts)


def _view_features(front: Any, records: Tensor, views: int, folder: Path, *, progress: bool,
                   label: str) -> Tensor:
    """(N, K, out_features): the front end's features of each record's first K views, each view's from the cache
    or computed and cached (view 0's is the records' own entry). Written into one tensor as they come, and the
    shifted views are not kept among the recent splits: K copies of the features are the memory's bound."""
    out = torch.empty(records.shape[0], views, front.out_features, dtype=records.dtype, device=records.device)
    for k, offset in enumerate(VIEW_OFFSETS[:views]):
        out[:, k] = features_of(front, shifted(records, offset), folder, progress=progress,
                                label=f"{label} view {k}", view=offset)
    return out


def features_of(front: Any, records: Tensor, folder: Path, *, progress: bool = False, label: str = "",
                view: tuple[int, int] = (0, 0)) -> Tensor:
    """The front end's features of `records` (N, in_features), from the cache or computed and cached. `view`: the
    shift (dpltm.data.views) that made `records` from the data's records, named in the cache key (the records'
    own features, view (0, 0), keep the key they always had); a shifted view is not kept among the recent splits."""
    width = records.shape[1] if records.dim() == 2 else -1
    if width == front.out_features:
        return records
    if width != front.in_features:
        raise DpltmUserError(f"the front end takes records of {front.in_features} values, got shape "
                             f"{tuple(records.shape)}")
    if records.shape[0] == 0:
        return records.new_zeros(0, front.out_features)
    settings = front.settings() if view == (0, 0) else {**front.settings(), "view": list(view)}
    key = cache_key(settings, records)
    path = folder / f"{key}.pt"
    features = _recent.pop(key, None)
    secret = cache_secret(folder) if features is None else None
    if features is None and secret is not None:
        features = read_cached(path, key, (records.shape[0], front.out_features), secret)
    if features is None:
        features = compute_features(front, records, progress=progress, label=label)
        if secret is not None:
            write_cached(path, key, settings, features, secret)
    if view != (0, 0):
        return features.to(device=records.device, dtype=records.dtype)
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


def _checksum(features: Tensor, secret: bytes = b"") -> str:
    """HMAC-SHA-256, keyed by `secret`, of the SHA-256s of the features' 32 MiB pieces, hashed in parallel
    threads (hashlib releases the GIL): a file of a gigabyte is checked at the speed of all the cores."""
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
    message = f"dpltm-feature-pieces:{CHECKSUM_PIECE}:".encode() + b"".join(digests)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


@torch.no_grad()
def compute_features(front: Any, records: Tensor, *, progress: bool = False, label: str = "") -> Tensor:
    """The front end over `records` in chunks, on the records' device; float32 on the CPU. Each
    record's features depend on that record alone (the transform and its normalisation are per record)."""
    from dpltm.progress import step_bar

    out = torch.empty(records.shape[0], front.out_features, dtype=torch.float32)
    with step_bar(f"features {label}".strip(), records.shape[0], enabled=progress) as bar:
        for start in range(0, records.shape[0], CHUNK):
            raise_if_stopping()
            chunk = records[start:start + CHUNK]
            out[start:start + chunk.shape[0]] = front(chunk).to("cpu", torch.float32)
            bar.update(chunk.shape[0])
    return out


def read_cached(path: Path, key: str, shape: tuple[int, int], secret: bytes) -> Tensor | None:
    """The cached features at `path` if the file is whole and is the one for `key`; None if there is
    none; a damaged or foreign file, or anything but a regular file, is reported on stderr and left to
    be rebuilt (the new file replaces it)."""
    try:
        with _open_regular(path) as handle:
            body = torch.load(handle, map_location="cpu", weights_only=True)
        problem = _problem(body, key, shape, secret)
    except FileNotFoundError:
        return None
    except _Unusable as exc:
        problem = str(exc)
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


class _Unusable(OSError):
    """A cache entry or key that is there but cannot be used (its message says why)."""


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file. Opened without blocking (a FIFO would wait for a
    writer) and checked on the open file, not on the name, so nothing can be swapped in between."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Unusable("not a regular file")
    return os.fdopen(fd, "rb")


EARLIER_FORMAT = "an earlier format"


def _problem(body: Any, key: str, shape: tuple[int, int], secret: bytes) -> str | None:
    if isinstance(body, dict) and type(body.get("format")) is int and 0 < body["format"] < CACHE_FORMAT:
        return EARLIER_FORMAT
    if not isinstance(body, dict) or body.get("format") != CACHE_FORMAT:
        return "not a dpltm feature cache"
    if body.get("key") != key:
        return "made for other records or settings"
    features = body.get("features")
    if not isinstance(features, Tensor) or tuple(features.shape) != shape or features.dtype != torch.float32:
        return "features of the wrong shape or type"
    if body.get("hmac") != _checksum(features, secret):
        return "checksum mismatch"
    return None


_UNWRITABLE: set[str] = set()
"""Cache folders this process could not use or write in (said once each)."""


def _note_once(folder: Path, note: str) -> None:
    if str(folder) not in _UNWRITABLE:  # once a folder per run, not once a split
        _UNWRITABLE.add(str(folder))
        print(note, file=sys.stderr)


def cache_secret(folder: Path) -> bytes | None:
    """The secret key of the cache folder, made (folder 0700, key 0600) on first use; None, with one note,
    if the folder cannot be used. An existing folder open to other users or owned by another is refused,
    not made private: a chmod would change a folder the user may share on purpose (even /tmp), would not
    take out what others already put there, and cannot be done on another user's folder at all."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = folder.stat()
        if info.st_uid == os.geteuid() and not info.st_mode & 0o077:
            return _secret_in(folder / KEY_FILE)
        why = (f"is open to other users (mode {stat.S_IMODE(info.st_mode):o}); make it private with "
               f"`chmod 700 {folder}` or" if info.st_uid == os.geteuid() else "belongs to another user;")
        note = f"feature cache not used: {folder} {why} set {CACHE_ENV} to a folder of your own"
    except _Unusable as exc:
        note = f"feature cache not used: {exc}"
    except (FileExistsError, NotADirectoryError):
        file = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        note = f"feature cache not written: {file} is a file, not a folder; remove it or set {CACHE_ENV} to a folder"
    except OSError as exc:
        note = f"feature cache not written ({folder}: {_why(exc)}); the features are not kept"
    _note_once(folder, note)
    return None


def _secret_in(path: Path) -> bytes:
    """The key in `path`, made on first use: written whole to a temp file (O_EXCL, 0600) and hard-linked
    into place, which never replaces a key, so concurrent runs agree on one and none reads a part."""
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(prefix=".key.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    try:
        with _open_regular(path) as handle:
            info, secret = os.fstat(handle.fileno()), handle.read(KEY_BYTES + 1)
        mine = info.st_uid == os.geteuid() and not info.st_mode & 0o077 and len(secret) == KEY_BYTES
    except _Unusable:
        mine = False
    if not mine:
        raise _Unusable(f"its key {path} is not a {KEY_BYTES}-byte file of yours alone; remove it (the cache is "
                      "then rebuilt)")
    return secret


_PLAINLY = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "file too large for the file-size limit",
            errno.EDQUOT: "disk quota exceeded"}


def _why(exc: BaseException) -> str:
    """What failed, in one line: the OSError behind the exception when there is one (torch's zip writer
    raises a RuntimeError after the write's OSError), in plain words when it is a full disk or a limit."""
    cause = os_error_behind(exc)
    if cause is not None:
        return _PLAINLY.get(cause.errno or 0, cause.strerror or str(cause))
    return " ".join(str(exc).split()) or type(exc).__name__


def write_cached(path: Path, key: str, settings: dict[str, Any], features: Tensor, secret: bytes) -> None:
    """Write a cache file atomically (temp file, fsync, rename), readable by the user alone. A cache that
    cannot be written is skipped with a note: the run goes on with the features it computed."""
    body = {"format": CACHE_FORMAT, "key": key, "settings": settings, "hmac": _checksum(features, secret),
            "features": features}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    except OSError as exc:
        _note_once(path.parent, f"feature cache not written ({path.parent}: {_why(exc)}); the features are not kept")
        return
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(body, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if not isinstance(exc, (OSError, RuntimeError)):  # torch's zip writer: RuntimeError on a failed write
            raise
        _note_once(path.parent, f"feature cache not written ({path}: {_why(exc)}); the features are not kept")
