"""IDX files (the MNIST family's format), read and written here so no torchvision is needed.

Layout: two zero bytes, a type code, the number of dimensions, one big-endian uint32 per
dimension, then the values in C order, big-endian. A name ending in `.gz` means gzip.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from dpltm.errors import DpltmUserError

# IDX type code -> on-disk dtype (always big-endian).
_TYPE_CODES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODE_OF_KIND: dict[tuple[str, int], int] = {
    (dtype.kind, dtype.itemsize): code for code, dtype in _TYPE_CODES.items()
}


def gunzip_if_named(data: bytes, path: str | os.PathLike[str]) -> bytes:
    """The content of a file: gunzipped when its name ends in `.gz`, as the archives ship it."""
    if not str(path).endswith(".gz"):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DpltmUserError(f"corrupt file {path}: not a valid gzip stream ({exc})") from None


def decode_idx(data: bytes, path: str | os.PathLike[str]) -> np.ndarray:
    """Parse uncompressed IDX bytes into a native-endian, writable array; `path` names errors."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _TYPE_CODES:
        magic = data[:4].hex() or "empty"
        raise DpltmUserError(f"corrupt file {path}: bad IDX magic 0x{magic}")
    dtype, ndim = _TYPE_CODES[data[2]], data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise DpltmUserError(f"corrupt file {path}: truncated IDX header ({ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise DpltmUserError(
            f"corrupt file {path}: IDX header says shape {tuple(shape)} ({expected} bytes of "
            f"data) but the file holds {len(data) - header}"
        )
    values = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzipped when the name ends in `.gz`) into a numpy array."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DpltmUserError(f"cannot read {path}: {exc.strerror or exc}") from None
    return decode_idx(gunzip_if_named(raw, path), path)


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Write `array` as IDX (gzip when the name ends in `.gz`); tests build fixtures with it."""
    array = np.asarray(array)
    code = _CODE_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"IDX needs 1 to 255 dimensions, got {array.ndim}")
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=_TYPE_CODES[code]).tobytes()
    path = Path(path)
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    path.write_bytes(payload)
    return path
