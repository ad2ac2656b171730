"""The text-table datasets: UCI HAR, ISOLET and DIGITS, each in its archive's own layout.

Every file may also be gzipped (`name.gz`). Features keep their authors' fixed scaling
(HAR and ISOLET are already in [-1, 1]; DIGITS counts 0..16 are divided by 16): nothing is
computed from the data, since data-dependent statistics would leak private information.

DIGITS is checked as the MNIST files are (dpltm.data.mnist): its md5 when the file has the
official name and size (scikit-learn's digits.csv.gz, or the csv inside it), and always its
structure: exactly 1797 rows with the official number per digit, 64 counts in 0..16 and a
label in 0..9. So a file cut short (300 of 1797 rows) is refused, while the synthetic files
tests write (same structure, other bytes) are accepted.

Official files: MNIST's family and DIGITS have published md5s, so a file that matches one is a
public fact. HAR and ISOLET have none (UCI publishes archives, not per-file digests): their
portions are never `official`, and released files record nothing derived from their records
(`dpltm.data.release`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpltm.data.catalog import DATASET_ENTRIES
from dpltm.data.sources import (
    Portion,
    find_file,
    integer_labels,
    is_dir,
    load_decoded,
    missing_file,
    official_md5,
    parse_table,
)
from dpltm.data.splits import record_split
from dpltm.errors import DpltmUserError

HAR_FEATURES, HAR_CLASSES = DATASET_ENTRIES["har"].num_features, DATASET_ENTRIES["har"].num_classes
ISOLET_FEATURES, ISOLET_CLASSES = DATASET_ENTRIES["isolet"].num_features, DATASET_ENTRIES["isolet"].num_classes
DIGITS_FEATURES, DIGITS_CLASSES = DATASET_ENTRIES["digits"].num_features, DATASET_ENTRIES["digits"].num_classes

HAR_DIRS = ("UCIHAR", "UCI HAR Dataset")
ISOLET_FILES = {"train": "isolet1+2+3+4.data", "test": "isolet5.data"}
DIGITS_FILE = Path("DIGITS") / "digits.csv.gz"
DIGITS_CLASS_COUNTS = (178, 182, 177, 183, 181, 182, 181, 179, 174, 180)  # 1797 rows in all
DIGITS_ROWS = sum(DIGITS_CLASS_COUNTS)
#: scikit-learn's digits.csv.gz and the csv inside it: (md5, size in bytes).
DIGITS_OFFICIAL: dict[str, tuple[str, int]] = {
    "digits.csv.gz": ("9b335364a7bfd63947c7480a5bd51f2d", 57523),
    "digits.csv": ("a0339c30a8a5312a1b6f9e5c719dcce5", 264712),
}
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # DIGITS has no official split; this fixed one stands in for it


def _with_gz(paths: list[Path]) -> list[Path]:
    """Each candidate as stored, then gzipped."""
    return [p for path in paths for p in (path, path.with_name(path.name + ".gz"))]


# ---- HAR ----------------------------------------------------------------------------------


def _decode_har_x(data: bytes, path: Path) -> tuple[np.ndarray, ...]:
    """X_*.txt: whitespace-separated floats such as `2.8858451e-001`, 561 per row."""
    return (parse_table(data, path, delimiter=None, columns=HAR_FEATURES).astype(np.float32),)


def _decode_har_y(data: bytes, path: Path) -> tuple[np.ndarray, ...]:
    """y_*.txt: one activity 1..6 per line, shifted to 0..5."""
    table = parse_table(data, path, delimiter=None, columns=1)
    return (integer_labels(table[:, 0], path, 1, HAR_CLASSES) - 1,)


def _har_path(root: Path, relative: str) -> Path:
    """`relative` under whichever HAR folder holds it; else the path the error should name."""
    candidates = _with_gz([root / folder / relative for folder in HAR_DIRS])
    found = find_file(candidates)
    if found is not None:
        return found
    folder = next((f for f in HAR_DIRS if is_dir(root / f)), HAR_DIRS[0])
    raise missing_file(
        root / folder / relative,
        f"UCI HAR Dataset archive; the folder may be named {' or '.join(map(repr, HAR_DIRS))}",
    )


def load_har(root: Path, portion: str) -> Portion:
    """UCI HAR `train/X_train.txt` + `train/y_train.txt` (or the `test` pair)."""
    x_path = _har_path(root, f"{portion}/X_{portion}.txt")
    y_path = _har_path(root, f"{portion}/y_{portion}.txt")
    x = load_decoded(x_path, _decode_har_x)
    y = load_decoded(y_path, _decode_har_y)
    features, labels = x.arrays[0], y.arrays[0]
    if features.shape[0] != labels.shape[0]:
        raise DpltmUserError(
            f"corrupt files: {x_path} has {features.shape[0]} rows but {y_path} has "
            f"{labels.shape[0]}"
        )
    return Portion(features, labels, ((f"har/X_{portion}", x.md5), (f"har/y_{portion}", y.md5)))


# ---- ISOLET -------------------------------------------------------------------------------


def _decode_isolet(data: bytes, path: Path) -> tuple[np.ndarray, ...]:
    """Rows of 617 comma-separated floats then the letter as ` 1.` .. ` 26.` (to 0..25)."""
    table = parse_table(data, path, delimiter=",", columns=ISOLET_FEATURES + 1)
    labels = integer_labels(table[:, -1], path, 1, ISOLET_CLASSES) - 1
    return table[:, :-1].astype(np.float32), labels


def load_isolet(root: Path, portion: str) -> Portion:
    """`ISOLET/isolet1+2+3+4.data` (train) or `ISOLET/isolet5.data` (test); root also works."""
    name = ISOLET_FILES[portion]
    path = find_file(_with_gz([root / "ISOLET" / name, root / name]))
    if path is None:
        raise missing_file(
            root / "ISOLET" / name, f"UCI ISOLET archive; {name}.gz and {root / name} also work"
        )
    decoded = load_decoded(path, _decode_isolet)
    features, labels = decoded.arrays
    return Portion(features, labels, ((f"isolet/{name}", decoded.md5),))


# ---- DIGITS -------------------------------------------------------------------------------


def _decode_digits(data: bytes, path: Path) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits.csv: 64 counts 0..16 then the digit, no header; all 1797 rows."""
    table = parse_table(data, path, delimiter=",", columns=DIGITS_FEATURES + 1)
    counts = integer_labels(table[:, :-1], path, 0, 16, what="pixel counts")
    labels = integer_labels(table[:, -1], path, 0, DIGITS_CLASSES - 1)
    per_class = tuple(np.bincount(labels, minlength=DIGITS_CLASSES).tolist())
    if per_class != DIGITS_CLASS_COUNTS:
        raise DpltmUserError(
            f"corrupt file {path}: DIGITS has {DIGITS_ROWS} rows ({', '.join(map(str, DIGITS_CLASS_COUNTS))} "
            f"per digit), found {labels.size} ({', '.join(map(str, per_class))}); download it again"
        )
    return (counts / 16.0).astype(np.float32), labels


def load_digits(root: Path, portion: str) -> Portion:
    """A fixed (seed 0) per-record 80/20 split of the 1797 rows stands in for train/test."""
    path = root / DIGITS_FILE
    found = find_file([path, path.with_suffix("")])
    if found is None:
        raise missing_file(path, "scikit-learn's digits.csv.gz; uncompressed digits.csv works")
    decoded = load_decoded(found, _decode_digits, official_md5(found, DIGITS_OFFICIAL))
    features, labels = decoded.arrays
    train, test = record_split(features, labels, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    rows = train if portion == "train" else test
    return Portion(features[rows], labels[rows], (("digits/digits.csv", decoded.md5),), official=decoded.official)
