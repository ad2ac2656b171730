"""Small files in each dataset's own on-disk format, written by tests (no network, no real data)."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from dpltm.data.idx import write_idx
from dpltm.data.tabular import DIGITS_CLASS_COUNTS


def uci_float(value: float) -> str:
    """HAR's number format: `2.8858451e-001` (three exponent digits)."""
    mantissa, exponent = f"{value:.7e}".split("e")
    return f"{mantissa}e{int(exponent):+04d}"


def write_har(root: Path, folder: str = "UCI HAR Dataset", n_train: int = 30, n_test: int = 12):
    """Tiny X/y files in the UCI HAR archive layout; returns {portion: (X, y)} as written."""
    rng = np.random.default_rng(0)
    written = {}
    for portion, rows in (("train", n_train), ("test", n_test)):
        cells = [[uci_float(v) for v in row] for row in rng.uniform(-1, 1, (rows, 561)).tolist()]
        y = np.arange(rows) % 6 + 1
        directory = root / folder / portion
        directory.mkdir(parents=True)
        lines = ("  " + " ".join(row) for row in cells)
        (directory / f"X_{portion}.txt").write_text("\n".join(lines) + "\n")
        (directory / f"y_{portion}.txt").write_text("".join(f"{v}\n" for v in y))
        written[portion] = (np.array(cells, dtype=np.float64).astype(np.float32), y)
    return written


def write_isolet(root: Path, *, gz: bool, subdir: str = "ISOLET"):
    """ISOLET files (617 values then ` N.`): 52 training rows, 26 test rows."""
    rng = np.random.default_rng(1)
    written = {}
    for name, rows in (("isolet1+2+3+4.data", 52), ("isolet5.data", 26)):
        x = np.round(rng.uniform(-1, 1, size=(rows, 617)), 4)
        y = np.arange(rows) % 26 + 1
        text = "".join(
            ",".join(f"{v:.4f}" for v in row) + f", {label}.\n"
            for row, label in zip(x.tolist(), y, strict=True)
        ).encode()
        directory = root / subdir
        directory.mkdir(parents=True, exist_ok=True)
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(text))
        else:
            (directory / name).write_bytes(text)
        written[name] = (x.astype(np.float32), y - 1)
    return written


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 50, n_test: int = 20, gz=True):
    """IDX fixtures in torchvision's layout; returns {portion: (images, labels)}. Each folder draws its own
    records: two datasets that shared them would be one dataset under two names (refused as tickets' data)."""
    rng = np.random.default_rng(2 if folder == "MNIST" else zlib.crc32(folder.encode()))
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    suffix = ".gz" if gz else ""
    written = {}
    for prefix, portion, n in (("train", "train", n_train), ("t10k", "test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
        written[portion] = (images, labels)
    return written


def write_digits(root: Path) -> Path:
    """DIGITS' format (64 ints in 0..16, then the label), learnable: noisy class prototypes.

    The loader checks DIGITS' structure, so this writes its 1797 rows with the official
    number per digit (other values, so not the official md5 or size)."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), DIGITS_CLASS_COUNTS)
    protos = rng.integers(0, 17, size=(10, 64))
    rows = np.clip(protos[labels] + rng.integers(-2, 3, size=(labels.size, 64)), 0, 16)
    (root / "DIGITS").mkdir(parents=True, exist_ok=True)
    text = "\n".join(",".join(map(str, [*r, y])) for r, y in zip(rows, labels)) + "\n"
    with gzip.open(root / "DIGITS" / "digits.csv.gz", "wt") as handle:
        handle.write(text)
    return root
