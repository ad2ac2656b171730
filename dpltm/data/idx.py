"""IDX files (the MNIST family's format), read and written here so no torchvision is needed.

Layout: two zero bytes, a type code, the number of dimensions, one big-endian uint32 per
dimension, then the values in C order, big-endian. A name ending in `.gz` means gzip.
"""

from __future__ import annotations

import gzip
import io
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


MAX_GUNZIPPED_BYTES = 1 << 28
"""256 MiB: more than any file dpltm reads holds unpacked (UCI HAR's largest, X_train.txt, is 66 MB)."""


def gunzip_if_named(data: bytes, path: str | os.PathLike[str], limit: int = MAX_GUNZIPPED_BYTES) -> bytes:
    """The content of a file: gunzipped when its name ends in `.gz`, as the archives ship it; refused once it
    passes `limit` bytes."""
    if not str(path).endswith(".gz"):
        return data
    return gunzip_at_most(data, path, limit)


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


def gunzip_at_most(data: bytes, path: str | os.PathLike[str], limit: int, truncate: bool = False) -> bytes:
    """The gunzipped content of `data`, refused as soon as it passes `limit` bytes (`truncate`: its first `limit`
    bytes instead): a small file that inflates without end (a corrupt or hostile archive) stops here, not when
    memory runs out."""
    bound = limit if truncate else limit + 1
    parts, size = [], 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            while size < bound:
                chunk = stream.read(min(GUNZIP_CHUNK, bound - size))
                if not chunk:
                    break
                parts.append(chunk)
                size += len(chunk)
    except (OSError, EOFError, zlib.error) as exc:
        raise DpltmUserError(f"corrupt file {path}: not a valid gzip stream ({exc})") from None
    if size > limit:
        raise DpltmUserError(f"corrupt file {path}: it inflates to more than the {limit} bytes its content can hold")
    return b"".join(parts)


GUNZIP_CHUNK = 1 << 24
MAX_IDX_BYTES = 1 << 30
"""An IDX header claiming more than 1 GiB of values is corrupt for every dataset dpltm reads (MNIST's
largest file holds 47 MB; EMNIST's, 0.55 GB)."""


def _idx_size(head: bytes, path: str | os.PathLike[str]) -> int:
    """The whole file's size in bytes as its header states it (magic and dimensions), checked."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _TYPE_CODES or head[3] == 0:
        decode_idx(head, path)  # says what is wrong, in its words
    ndim = head[3]
    if len(head) < 4 + 4 * ndim:
        raise DpltmUserError(f"corrupt file {path}: truncated IDX header ({ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", head[4:4 + 4 * ndim])
    size = int(np.prod(shape, dtype=object)) * _TYPE_CODES[head[2]].itemsize
    if size > MAX_IDX_BYTES:
        raise DpltmUserError(f"corrupt file {path}: IDX header says shape {tuple(shape)}, {size} bytes of data")
    return 4 + 4 * ndim + size


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzipped when the name ends in `.gz`) into a numpy array; a gzipped one is inflated only as
    far as its header's size (plus one byte, to tell a longer file)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DpltmUserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not str(path).endswith(".gz"):
        return decode_idx(raw, path)
    size = _idx_size(gunzip_at_most(raw, path, 4 + 4 * 255, truncate=True), path)
    data = gunzip_at_most(raw, path, size + 1, truncate=True)  # one byte past the header's size tells a longer file
    if len(data) > size:
        header = 4 + 4 * data[3]
        raise DpltmUserError(f"corrupt file {path}: the IDX header says {size - header} bytes of data but the file "
                             "holds more")
    return decode_idx(data, path)


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
