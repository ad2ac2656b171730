"""Raw files on disk: finding them, hashing them, decoding them once per process.

Every decoder is keyed by (resolved path, size, mtime), so a second `load_dataset` call in the
same process reuses the decoded arrays, while a replaced file is decoded afresh.
"""

from __future__ import annotations

import functools
import hashlib
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpltm.data.idx import gunzip_if_named
from dpltm.errors import DpltmUserError
from dpltm.paths import note_input

Decoder = Callable[[bytes, Path], tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Portion:
    """One official portion (train or test) of a dataset, normalised, on the CPU.

    `files` pairs each raw file's role with the md5 of its bytes, for the fingerprint. `official`:
    every one of those files matched its official published md5, so the fingerprint is a public
    fact and not a function of a user's records (`dpltm.data.release`).
    """

    features: np.ndarray
    labels: np.ndarray
    files: tuple[tuple[str, str], ...]
    official: bool = False

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Decoded:
    """Read-only decoded arrays of one file and the md5 of the file's bytes on disk.

    `official`: the bytes were checked against, and match, the official published md5.
    """

    arrays: tuple[np.ndarray, ...]
    md5: str
    official: bool = False


def _unreadable(path: Path, exc: OSError) -> DpltmUserError:
    return DpltmUserError(f"cannot read {exc.filename or path}: {exc.strerror or exc}")


def find_file(candidates: Sequence[Path]) -> Path | None:
    """The first candidate that exists: archives differ in folder names and compression.

    A folder that cannot be searched (no permission) is a one-line error naming the path,
    not a missing file: the data may well be there.
    """
    not_a_file = None
    for path in candidates:
        try:
            if path.is_file():
                note_input(path)
                return path
            if not_a_file is None and (path.is_symlink() or path.exists()):
                not_a_file = path
        except OSError as exc:
            raise _unreadable(path, exc) from None
    if not_a_file is not None:  # there, but not a file: say what it is, not "missing"
        raise DpltmUserError(f"{not_a_file} is {_what_it_is(not_a_file)}, not a data file: put the file itself there")
    return None


def _what_it_is(path: Path) -> str:
    try:
        if path.is_dir():
            return "a folder"
        if path.exists():
            return "a device, pipe or socket"
    except OSError:
        pass
    return "a symbolic link to nothing readable (dangling, or a loop)"


def is_dir(path: Path) -> bool:
    """`path.is_dir()`, with an unsearchable parent as a one-line error naming the path."""
    try:
        return path.is_dir()
    except OSError as exc:
        raise _unreadable(path, exc) from None


def official_md5(path: Path, official: dict[str, tuple[str, int]]) -> str | None:
    """The official md5 to enforce for `path`, or None.

    `official` maps an archive's file names to (md5, size in bytes). A file is checked
    against its official md5 only when its name is an official name *and* its size is the
    official size: a file cut short has another size and fails the dataset's structural
    checks instead, and small fixture files written by tests are only checked structurally.
    """
    entry = official.get(path.name)
    if entry is None:
        return None
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _unreadable(path, exc) from None
    return entry[0] if size == entry[1] else None


def missing_file(path: Path, hint: str = "") -> DpltmUserError:
    """The one-line error for a file the loader needs and did not find."""
    return DpltmUserError(f"missing file {path}" + (f" ({hint})" if hint else ""))


def load_decoded(path: Path, decode: Decoder, expected_md5: str | None = None) -> Decoded:
    """Decode `path` with `decode`, once per process per file version.

    With `expected_md5`, the bytes on disk must hash to it (checked before decoding).
    """
    try:
        stat = path.stat()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    return _load_decoded(str(path.resolve()), stat.st_size, stat.st_mtime_ns, decode, expected_md5)


@functools.lru_cache(maxsize=32)
def _load_decoded(
    path: str, size: int, mtime_ns: int, decode: Decoder, expected_md5: str | None
) -> Decoded:
    """The cached body of `load_decoded`; size and mtime are only part of the key."""
    del size, mtime_ns
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DpltmUserError(f"cannot read {path}: {exc.strerror or exc}") from None
    md5 = hashlib.md5(raw).hexdigest()
    if expected_md5 is not None and md5 != expected_md5:
        raise DpltmUserError(
            f"corrupt file {path}: md5 {md5} differs from the official {expected_md5}; "
            f"download it again"
        )
    arrays = decode(gunzip_if_named(raw, path), Path(path))
    for array in arrays:
        array.setflags(write=False)
    return Decoded(arrays=arrays, md5=md5, official=expected_md5 is not None)


def clear_cache() -> None:
    """Forget every decoded file (tests, or to free memory)."""
    _load_decoded.cache_clear()


def parse_table(data: bytes, path: Path, *, delimiter: str | None, columns: int) -> np.ndarray:
    """A text table as float64 [rows, columns]; any unparseable row names the file."""
    try:
        text = data.decode("ascii")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file is reported below, not warned
            table = np.loadtxt(io.StringIO(text), delimiter=delimiter, dtype=np.float64, ndmin=2)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())
        reason = reason.split("; use `usecols`")[0][:200]  # numpy's advice is for its own API, not for a dpltm user
        raise DpltmUserError(f"corrupt file {path}: {reason}") from None
    if table.shape[0] == 0:
        raise DpltmUserError(f"corrupt file {path}: no data rows")
    if table.shape[1] != columns:
        raise DpltmUserError(
            f"corrupt file {path}: expected {columns} values per row, found {table.shape[1]}"
        )
    if not np.isfinite(table).all():
        raise DpltmUserError(f"corrupt file {path}: contains non-finite values")
    return table


def integer_labels(
    values: np.ndarray, path: Path, low: int, high: int, what: str = "labels"
) -> np.ndarray:
    """Values as int64, checked to be whole numbers in [low, high] (as the archive defines)."""
    if values.size and (
        not np.array_equal(values, np.round(values)) or values.min() < low or values.max() > high
    ):
        raise DpltmUserError(f"corrupt file {path}: {what} must be whole numbers {low}..{high}")
    return values.astype(np.int64)
