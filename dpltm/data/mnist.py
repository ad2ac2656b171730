"""MNIST, Fashion-MNIST and KMNIST from IDX files in torchvision's folder layout.

`<root>/<Folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`, read with our own
IDX reader (no torchvision at runtime, no per-image decoding).

md5 verification: a file is checked against its official md5 (torchvision's list) only when
its name is an official file name *and* its size equals the official file's size. A
download truncated or cut short has another size and fails the structural checks instead;
small fixture files written by tests have other sizes and are only checked structurally
(`sources.official_md5`). Uncompressed files have no published md5 and are only checked
structurally. A `raw/` folder that cannot be read is a one-line error naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpltm.data.idx import decode_idx
from dpltm.data.sources import Decoded, Portion, find_file, load_decoded, missing_file, official_md5
from dpltm.errors import DpltmUserError

FOLDERS: dict[str, str] = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "kmnist": "KMNIST"}
IMAGE_SIDE = 28
NUM_CLASSES = 10

# Portion -> (images file, labels file), without the `.gz`.
_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# Folder -> official .gz file -> (md5, size in bytes); md5s as in torchvision's mnist.py.
OFFICIAL: dict[str, dict[str, tuple[str, int]]] = {
    "MNIST": {
        "train-images-idx3-ubyte.gz": ("f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
        "train-labels-idx1-ubyte.gz": ("d53e105ee54ea40749a09fcbcd1e9432", 28881),
        "t10k-images-idx3-ubyte.gz": ("9fb629c4189551a2d022fa330f9573f3", 1648877),
        "t10k-labels-idx1-ubyte.gz": ("ec29112dd5afa0611ce80d1b7f02629c", 4542),
    },
    "FashionMNIST": {
        "train-images-idx3-ubyte.gz": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
        "train-labels-idx1-ubyte.gz": ("25c81989df183df01b3e8a0aad5dffbe", 29515),
        "t10k-images-idx3-ubyte.gz": ("bef4ecab320f06d8554ea6380940ec79", 4422102),
        "t10k-labels-idx1-ubyte.gz": ("bb300cfdad3c16e7a12a480ee83cd310", 5148),
    },
    "KMNIST": {
        "train-images-idx3-ubyte.gz": ("bdb82020997e1d708af4cf47b453dcf7", 18165135),
        "train-labels-idx1-ubyte.gz": ("e144d726b3acfaa3e44228e80efcd344", 29497),
        "t10k-images-idx3-ubyte.gz": ("5c965bf0a639b31b8f53240b1b52f4d7", 3041136),
        "t10k-labels-idx1-ubyte.gz": ("7320c461ea6c1c855c0b718fb2a4b134", 5120),
    },
}


def _decode_idx(data: bytes, path: Path) -> tuple[np.ndarray, ...]:
    """`decode_idx` in the shape the file cache wants."""
    return (decode_idx(data, path),)


def _read(root: Path, folder: str, stem: str) -> tuple[Decoded, Path]:
    """One IDX file of the dataset (.gz preferred): its decoded array and md5, and its path."""
    raw_dir = root / folder / "raw"
    path = find_file([raw_dir / f"{stem}.gz", raw_dir / stem])
    if path is None:
        official = OFFICIAL[folder].get(f"{stem}.gz")
        hint = f"official md5 {official[0]}; " if official else ""
        raise missing_file(raw_dir / f"{stem}.gz", f"{hint}the uncompressed {stem} also works")
    return load_decoded(path, _decode_idx, official_md5(path, OFFICIAL[folder])), path


def load_portion(name: str, root: Path, portion: str) -> Portion:
    """The official `portion` ("train" or "test") of `name`: pixels / 255, 784 features."""
    folder = FOLDERS[name]
    images_stem, labels_stem = _FILES[portion]
    images_file, images_path = _read(root, folder, images_stem)
    labels_file, labels_path = _read(root, folder, labels_stem)
    images, labels = images_file.arrays[0], labels_file.arrays[0]
    if images.dtype != np.uint8 or images.shape[1:] != (IMAGE_SIDE, IMAGE_SIDE):
        raise DpltmUserError(
            f"corrupt file {images_path}: expected uint8 images of {IMAGE_SIDE}x{IMAGE_SIDE}, "
            f"found {images.dtype} of shape {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DpltmUserError(f"corrupt file {labels_path}: expected one uint8 label per image")
    if labels.shape[0] != images.shape[0]:
        raise DpltmUserError(
            f"corrupt files: {images_path} holds {images.shape[0]} images but "
            f"{labels_path} holds {labels.shape[0]} labels"
        )
    if labels.size and labels.max() >= NUM_CLASSES:
        raise DpltmUserError(f"corrupt file {labels_path}: labels must be 0..{NUM_CLASSES - 1}")
    features = images.reshape(images.shape[0], -1).astype(np.float32)
    features /= 255.0
    return Portion(
        features=features,
        labels=labels.astype(np.int64),
        files=((f"{folder}/{images_stem}", images_file.md5), (f"{folder}/{labels_stem}", labels_file.md5)),
        official=images_file.official and labels_file.official,
    )
