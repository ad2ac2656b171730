"""Dataset loaders: real files when present (skipped otherwise), small archive-format fixtures."""

from __future__ import annotations

import gzip
import math
import os
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpltm.data import DATASETS, SPLITS, load_dataset, mnist, sources
from dpltm.data.idx import read_idx, write_idx
from dpltm.data.splits import derive_seed, holdout_mask, holdout_threshold, record_split
from dpltm.errors import DpltmUserError
from dpltm.paths import DATA_DIR_ENV, resolve_data_dir
from tests.datafiles import write_har as _write_har
from tests.datafiles import write_isolet as _write_isolet
from tests.datafiles import write_mnist as _write_mnist

# ---- helpers ------------------------------------------------------------------------------


def _real_root(*relative: str) -> Path:
    """The real data directory, or skip the test when it or any of `relative` is absent."""
    try:
        root = resolve_data_dir(None)
    except DpltmUserError as exc:
        pytest.skip(f"no real data directory: {exc}")
    for rel in relative:
        if not (root / rel).is_file():
            pytest.skip(f"real data file {root / rel} is absent")
    return root


def _assert_partition(pool: np.ndarray, *parts: np.ndarray) -> None:
    """The parts' rows together are the pool's rows (as multisets of distinct random rows)."""
    joined = np.concatenate(parts)
    assert joined.shape == pool.shape
    assert _rows(joined) == _rows(pool)


def _rows(array: np.ndarray | torch.Tensor) -> list[bytes]:
    """The rows of `array` as a sorted list of byte strings (a multiset of rows)."""
    if isinstance(array, torch.Tensor):
        array = array.numpy()
    return sorted(map(bytes, np.ascontiguousarray(array)))


def _near(count: int, n: int, fraction: float, sds: float = 5.0) -> bool:
    """`count` is within `sds` binomial standard deviations (plus one) of fraction x n."""
    return abs(count - fraction * n) <= sds * math.sqrt(n * fraction * (1 - fraction)) + 1.0


# ---- IDX ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32])
def test_idx_round_trip(tmp_path: Path, name: str, dtype: type) -> None:
    array = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4)
    array = array.astype(dtype) if dtype is not np.uint8 else np.abs(array).astype(np.uint8)
    back = read_idx(write_idx(tmp_path / name, array))
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_idx_bad_magic_and_truncation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.idx"
    bad.write_bytes(b"\x12\x34\x08\x01" + bytes(8))
    with pytest.raises(DpltmUserError, match=r"bad\.idx: bad IDX magic"):
        read_idx(bad)
    good = write_idx(tmp_path / "short.idx", np.zeros((4, 5), dtype=np.uint8))
    good.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(DpltmUserError, match=r"short\.idx: IDX header says shape \(4, 5\)"):
        read_idx(good)
    (tmp_path / "x.gz").write_bytes(b"not gzip")
    with pytest.raises(DpltmUserError, match=r"x\.gz: not a valid gzip"):
        read_idx(tmp_path / "x.gz")


def test_a_gzip_that_inflates_past_its_content_is_refused_early(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An IDX whose header promises 20 bytes but whose gzip inflates to 64 MiB is read only as far as the header's
    size (plus a byte), and a gzipped table past the cap is refused, both in one line naming the file; truncated
    and header-less gzipped IDX files keep their messages."""
    from dpltm.data import idx

    header = b"\x00\x00\x08\x02" + (4).to_bytes(4, "big") + (5).to_bytes(4, "big")
    bomb = tmp_path / "bomb-idx1-ubyte.gz"
    bomb.write_bytes(gzip.compress(header + bytes(64 << 20)))
    read: list[int] = []
    real = idx.gunzip_at_most
    monkeypatch.setattr(idx, "gunzip_at_most", lambda *a, **k: read.append(a[2]) or real(*a, **k))
    with pytest.raises(DpltmUserError, match=r"bomb-idx1-ubyte\.gz: the IDX header says 20 bytes of data but the "
                                             r"file holds more"):
        read_idx(bomb)
    assert read == [4 + 4 * 255, 12 + 20 + 1]  # the longest header, then its size and the byte that tells more
    with pytest.raises(DpltmUserError, match=r"table\.csv\.gz: it inflates to more than the 1000 bytes"):
        idx.gunzip_if_named(gzip.compress(bytes(5000)), "table.csv.gz", limit=1000)
    short = tmp_path / "short-idx1-ubyte.gz"
    short.write_bytes(gzip.compress(header + bytes(7)))
    with pytest.raises(DpltmUserError, match=r"IDX header says shape \(4, 5\)"):
        read_idx(short)
    huge = tmp_path / "huge-idx1-ubyte.gz"
    huge.write_bytes(gzip.compress(b"\x00\x00\x08\x03" + (2**32 - 1).to_bytes(4, "big") * 3))
    with pytest.raises(DpltmUserError, match="IDX header says shape"):
        read_idx(huge)
    empty = tmp_path / "empty-idx1-ubyte.gz"
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(DpltmUserError, match="bad IDX magic"):
        read_idx(empty)


def test_idx_reader_matches_torchvision_on_real_mnist(tmp_path: Path) -> None:
    root = _real_root("MNIST/raw/t10k-images-idx3-ubyte.gz", "MNIST/raw/t10k-labels-idx1-ubyte.gz")
    tv = pytest.importorskip("torchvision.datasets.mnist", reason="torchvision not importable")
    for stem, reader in (
        ("t10k-images-idx3-ubyte", tv.read_image_file),
        ("t10k-labels-idx1-ubyte", tv.read_label_file),
    ):
        plain = tmp_path / stem
        with gzip.open(root / "MNIST" / "raw" / f"{stem}.gz") as src, plain.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        ours = read_idx(plain)
        np.testing.assert_array_equal(ours, reader(str(plain)).numpy())
        np.testing.assert_array_equal(ours, read_idx(root / "MNIST" / "raw" / f"{stem}.gz"))


# ---- real data (skipped when absent) ------------------------------------------------------


def test_real_mnist_train() -> None:
    root = _real_root(*(f"MNIST/raw/{f}" for f in mnist.OFFICIAL["MNIST"]))
    data = load_dataset("mnist", split="train", data_dir=root, val_fraction=0.1, seed=0)
    assert (data.num_features, data.num_classes, data.source_split) == (784, 10, "train")
    assert len(data.train) + len(data.val) == 60000 and _near(len(data.val), 60000, 0.1)
    assert len(data.test) == 10000
    for part in (data.train, data.val, data.test):
        assert part.features.dtype == torch.float32 and part.labels.dtype == torch.int64
        assert part.features.shape[1] == 784
        assert 0.0 <= float(part.features.min()) and float(part.features.max()) <= 1.0
    assert set(data.train.labels.unique().tolist()) == set(range(10))
    # train + val is exactly the official training pool, split by disjoint index sets.
    pool = mnist.load_portion("mnist", root, "train")
    kept, held = record_split(pool.features, pool.labels, 0.1, derive_seed(0, "val"))
    assert np.intersect1d(kept, held).size == 0 and kept.size + held.size == 60000
    np.testing.assert_array_equal(data.train.labels.numpy(), pool.labels[kept])
    np.testing.assert_array_equal(data.val.features.numpy(), pool.features[held])
    again = load_dataset("mnist", split="train", data_dir=root)
    assert again.fingerprint == data.fingerprint and len(data.fingerprint) == 16
    assert load_dataset("mnist", data_dir=root, seed=1).fingerprint != data.fingerprint


def test_real_fashion_mnist_test_split() -> None:
    root = _real_root("FashionMNIST/raw/t10k-images-idx3-ubyte.gz")
    data = load_dataset("fashion-mnist", split="test", data_dir=root, val_fraction=0.1)
    n_train, n_val, n_test = len(data.train), len(data.val), len(data.test)
    assert n_train + n_val + n_test == 10000 and _near(n_test, 10000, 0.2)
    assert _near(n_val, n_train + n_val, 0.1)
    assert data.train.features.shape[1] == data.val.features.shape[1] == 784
    assert data.test.features.shape == (n_test, 784) and data.test.labels.shape == (n_test,)


def test_real_kmnist_test_works_and_train_names_missing_file() -> None:
    root = _real_root(
        "KMNIST/raw/t10k-images-idx3-ubyte.gz", "KMNIST/raw/t10k-labels-idx1-ubyte.gz"
    )
    data = load_dataset("kmnist", split="test", data_dir=root, val_fraction=0.1)
    assert len(data.train) + len(data.val) + len(data.test) == 10000
    # Per-record hold-outs: per-class counts are binomial around the quota, not exact.
    assert all(_near(c, 1000, 0.2) for c in torch.bincount(data.test.labels, minlength=10).tolist())
    pool_counts = torch.bincount(torch.cat([data.train.labels, data.val.labels]), minlength=10)
    val_counts = torch.bincount(data.val.labels, minlength=10)
    assert all(_near(int(v), int(p), 0.1) for v, p in zip(val_counts, pool_counts, strict=True))
    if (root / "KMNIST/raw/train-images-idx3-ubyte.gz").exists():
        pytest.skip("KMNIST train images are present; the missing-file case cannot be shown")
    with pytest.raises(
        DpltmUserError, match=r"train-images-idx3-ubyte\.gz.*bdb82020997e1d708af4cf47b453dcf7"
    ):
        load_dataset("kmnist", split="train", data_dir=root)


def test_real_digits_fixed_split() -> None:
    root = _real_root("DIGITS/digits.csv.gz")
    data = load_dataset("digits", data_dir=root, val_fraction=0.0)
    assert (data.num_features, data.num_classes) == (64, 10)
    assert data.train.features.shape[1] == 64 and len(data.train) + len(data.test) == 1797
    assert 0.0 <= float(data.train.features.min()) and float(data.train.features.max()) <= 1.0
    per_class = torch.bincount(torch.cat([data.train.labels, data.test.labels]), minlength=10)
    test_counts = torch.bincount(data.test.labels, minlength=10)
    # per-record rule: each class gives up about 20 % (binomial, 5 standard deviations)
    assert ((test_counts.double() - 0.2 * per_class.double()).abs() <= 5 * (0.16 * per_class.double()).sqrt()).all()
    # The official stand-in split is fixed (seed 0), whatever `seed` is.
    other = load_dataset("digits", data_dir=root, val_fraction=0.0, seed=5)
    assert torch.equal(other.test.features, data.test.features)
    pooled = load_dataset("digits", split="all", data_dir=root, val_fraction=0.1)
    assert len(pooled.train) + len(pooled.val) + len(pooled.test) == 1797


# ---- fixtures in the archive formats ------------------------------------------------------


@pytest.mark.parametrize("folder", ["UCI HAR Dataset", "UCIHAR"])
def test_har_fixture(tmp_path: Path, folder: str) -> None:
    written = _write_har(tmp_path, folder)
    data = load_dataset("har", data_dir=tmp_path, val_fraction=0.1)
    assert (data.num_features, data.num_classes) == (561, 6)
    assert len(data.train) + len(data.val) == 30 and 0 < len(data.val) < 30
    x_test, y_test = written["test"]
    np.testing.assert_array_equal(data.test.features.numpy(), x_test)
    np.testing.assert_array_equal(data.test.labels.numpy(), y_test - 1)
    assert data.train.labels.min() >= 0 and data.train.labels.max() <= 5
    x_train, _ = written["train"]
    _assert_partition(x_train, data.train.features.numpy(), data.val.features.numpy())


def test_har_row_mismatch_and_bad_row(tmp_path: Path) -> None:
    _write_har(tmp_path)
    y = tmp_path / "UCI HAR Dataset" / "test" / "y_test.txt"
    y.write_text(y.read_text() + "3\n")
    with pytest.raises(DpltmUserError, match=r"X_test\.txt has 12 rows but .*y_test\.txt has 13"):
        load_dataset("har", split="test", data_dir=tmp_path)
    y.write_text("1\n" * 11 + "one\n")
    with pytest.raises(DpltmUserError, match=r"corrupt file .*y_test\.txt"):
        load_dataset("har", split="test", data_dir=tmp_path)
    y.write_text("7\n" * 12)
    with pytest.raises(DpltmUserError, match=r"y_test\.txt: labels must be whole numbers 1\.\.6"):
        load_dataset("har", split="test", data_dir=tmp_path)


@pytest.mark.parametrize(("gz", "subdir"), [(False, "ISOLET"), (True, "ISOLET"), (False, ".")])
def test_isolet_fixture(tmp_path: Path, gz: bool, subdir: str) -> None:
    written = _write_isolet(tmp_path, gz=gz, subdir=subdir)
    data = load_dataset("isolet", data_dir=tmp_path, val_fraction=0.0)
    assert (data.num_features, data.num_classes) == (617, 26)
    x_test, y_test = written["isolet5.data"]
    np.testing.assert_array_equal(data.test.features.numpy(), x_test)
    np.testing.assert_array_equal(data.test.labels.numpy(), y_test)
    assert sorted(data.train.labels.unique().tolist()) == list(range(26))
    assert data.val.features.shape == (0, 617) and data.val.labels.shape == (0,)


def test_isolet_unparseable_row(tmp_path: Path) -> None:
    _write_isolet(tmp_path, gz=False)
    path = tmp_path / "ISOLET" / "isolet5.data"
    path.write_text(path.read_text().replace(",", ";", 5))
    with pytest.raises(DpltmUserError, match=r"corrupt file .*isolet5\.data"):
        load_dataset("isolet", split="test", data_dir=tmp_path)


def test_a_ragged_table_says_which_row_without_numpys_advice(tmp_path: Path) -> None:
    """numpy's error for a row of another length ends with advice for its own API (`usecols`): not shown."""
    from dpltm.data.sources import parse_table

    with pytest.raises(DpltmUserError) as caught:
        parse_table(b"1,2,3\n4,5,6\n7,8\n", tmp_path / "t.csv", delimiter=",", columns=3)
    message = str(caught.value)
    assert message.startswith(f"corrupt file {tmp_path / 't.csv'}: ") and "usecols" not in message
    assert "row" in message


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_family_fixture(tmp_path: Path, gz: bool) -> None:
    written = _write_mnist(tmp_path, "KMNIST", gz=gz)
    data = load_dataset("kmnist", data_dir=tmp_path, val_fraction=0.2)
    images, labels = written["test"]
    np.testing.assert_allclose(data.test.features.numpy(), images.reshape(20, 784) / 255.0)
    np.testing.assert_array_equal(data.test.labels.numpy(), labels)
    assert len(data.train) + len(data.val) == 50 and _near(len(data.val), 50, 0.2)
    train_images = written["train"][0].reshape(50, 784).astype(np.float32) / 255.0
    _assert_partition(train_images, data.train.features.numpy(), data.val.features.numpy())


def test_one_run_loads_each_dataset_once(tmp_path: Path) -> None:
    """Inside `each_dataset_loaded_once` (a `dpltm run`) the same arguments give the same splits, read once;
    other arguments give their own; outside it every call loads afresh."""
    from dpltm.data.loaders import each_dataset_loaded_once

    _write_mnist(tmp_path)
    outside = load_dataset("mnist", data_dir=tmp_path)
    assert load_dataset("mnist", data_dir=tmp_path) is not outside
    with each_dataset_loaded_once():
        first = load_dataset("mnist", data_dir=tmp_path)
        with each_dataset_loaded_once():  # a stage inside the run keeps the run's
            assert load_dataset("mnist", data_dir=tmp_path) is first
        assert load_dataset("mnist", data_dir=tmp_path, val_fraction=0.1, seed=0) is first
        assert load_dataset("mnist", data_dir=tmp_path, seed=1) is not first
        assert load_dataset("mnist", data_dir=tmp_path, split="all") is not first
        assert first.fingerprint == outside.fingerprint
        assert torch.equal(first.train.features, outside.train.features)
    assert load_dataset("mnist", data_dir=tmp_path) is not first


@pytest.mark.parametrize("split", SPLITS)
def test_split_sizes_add_up(tmp_path: Path, split: str) -> None:
    _write_mnist(tmp_path)
    train_and_val, test = {"train": (50, 20), "test": (16, 4), "all": (56, 14)}[split]
    data = load_dataset("mnist", split=split, data_dir=tmp_path, val_fraction=0.1)
    assert len(data.train) + len(data.val) + len(data.test) == train_and_val + test
    if split == "train":  # official test set
        assert len(data.test) == test
    else:  # per-record 80/20 of the pool
        assert _near(len(data.test), train_and_val + test, 0.2)
    assert _near(len(data.val), len(data.train) + len(data.val), 0.1)
    assert data.source_split == split


def test_corrupt_magic_names_file(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x99\x03" + bytes(16)))
    with pytest.raises(DpltmUserError, match=r"t10k-images-idx3-ubyte\.gz: bad IDX magic"):
        load_dataset("mnist", split="test", data_dir=tmp_path)


def test_md5_checked_for_official_name_and_size(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    md5, size = mnist.OFFICIAL["MNIST"]["t10k-labels-idx1-ubyte.gz"]
    path = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(bytes(size))
    with pytest.raises(DpltmUserError, match=rf"t10k-labels-idx1-ubyte\.gz: md5 .* {md5}"):
        load_dataset("mnist", split="test", data_dir=tmp_path)


def test_missing_file_names_path_and_md5(tmp_path: Path) -> None:
    expected = tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte.gz"
    with pytest.raises(DpltmUserError, match=r"8d4fb7e6c68d591d4c3dfef9ec88bf0d") as info:
        load_dataset("fashion-mnist", data_dir=tmp_path)
    assert f"missing file {expected}" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DpltmUserError, match=r"missing file .*UCIHAR.*X_train\.txt"):
        load_dataset("har", data_dir=tmp_path)
    with pytest.raises(DpltmUserError, match=r"missing file .*ISOLET.*isolet5\.data"):
        load_dataset("isolet", split="test", data_dir=tmp_path)
    with pytest.raises(DpltmUserError, match=r"missing file .*DIGITS.*digits\.csv\.gz"):
        load_dataset("digits", data_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "cifar"}, "choose one of: " + ", ".join(DATASETS)),
        ({"name": "mnist", "split": "val"}, "choose one of: train, test, all"),
        ({"name": "mnist", "val_fraction": 0.5}, r"val_fraction must be a number in \[0, 0\.5\)"),
        ({"name": "mnist", "val_fraction": -0.1}, "val_fraction"),
        ({"name": "mnist", "val_fraction": float("nan")}, "val_fraction"),
        ({"name": "mnist", "seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_options(tmp_path: Path, kwargs: dict, message: str) -> None:
    name = kwargs.pop("name")
    with pytest.raises(DpltmUserError, match=message):
        load_dataset(name, data_dir=tmp_path, **kwargs)


def test_env_var_and_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixture, empty = tmp_path / "fixture", tmp_path / "empty"
    empty.mkdir()
    _write_har(fixture)
    monkeypatch.setenv(DATA_DIR_ENV, str(fixture))
    assert len(load_dataset("har").test) == 12
    with pytest.raises(DpltmUserError, match=f"missing file {empty}"):
        load_dataset("har", data_dir=empty)
    monkeypatch.setenv(DATA_DIR_ENV, str(empty))
    assert len(load_dataset("har", data_dir=fixture).test) == 12


def test_fingerprint_tracks_options_and_bytes(tmp_path: Path) -> None:
    _write_har(tmp_path)
    base = load_dataset("har", data_dir=tmp_path).fingerprint
    assert load_dataset("har", data_dir=tmp_path).fingerprint == base
    variants = [
        load_dataset("har", data_dir=tmp_path, seed=1).fingerprint,
        load_dataset("har", data_dir=tmp_path, val_fraction=0.2).fingerprint,
        load_dataset("har", data_dir=tmp_path, split="all").fingerprint,
    ]
    assert len({base, *variants}) == 4
    y = tmp_path / "UCI HAR Dataset" / "test" / "y_test.txt"
    y.write_text("\n".join(["2"] + y.read_text().split()[1:]) + "\n")
    os.utime(y, ns=(1, 1))
    assert load_dataset("har", data_dir=tmp_path).fingerprint != base


def test_decoding_is_cached_and_rng_untouched(tmp_path: Path) -> None:
    _write_isolet(tmp_path, gz=True)
    sources.clear_cache()
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    first = load_dataset("isolet", data_dir=tmp_path)
    original = first.test.features.clone()
    first.test.features.zero_()  # callers may write to their tensors: the cache must not see it
    misses = sources._load_decoded.cache_info().misses
    second = load_dataset("isolet", data_dir=tmp_path, seed=3)
    assert sources._load_decoded.cache_info().misses == misses
    assert torch.equal(second.test.features, original)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state)


def test_device_option(tmp_path: Path) -> None:
    _write_har(tmp_path)
    data = load_dataset("har", data_dir=tmp_path, device=torch.device("cpu"))
    assert data.train.features.device.type == "cpu"
    with pytest.raises(DpltmUserError, match="bad device"):
        load_dataset("har", data_dir=tmp_path, device="nonsense")


# ---- per-record split properties ---------------------------------------------------------


def _records(n: int, seed: int, width: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, width), dtype=np.float32), rng.integers(0, 5, n)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 150), fraction=st.floats(0.0, 0.95), seed=st.integers(0, 2**32))
def test_record_split_partitions_and_is_deterministic(n: int, fraction: float, seed: int) -> None:
    features, labels = _records(n, seed)
    kept, held = record_split(features, labels, fraction, seed)
    assert np.intersect1d(kept, held).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, held])), np.arange(n))
    assert np.all(np.diff(kept) > 0) and np.all(np.diff(held) > 0)
    kept2, held2 = record_split(torch.from_numpy(features), torch.from_numpy(labels), fraction, seed)
    np.testing.assert_array_equal(kept, kept2)
    np.testing.assert_array_equal(held, held2)
    assert _near(held.size, n, fraction, sds=6.0)
    if fraction == 0.0:
        assert held.size == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    fraction=st.floats(0.01, 0.9),
    seed=st.integers(0, 2**32),
    where=st.floats(0.0, 1.0),
    duplicate=st.booleans(),
)
def test_neighbouring_datasets_change_one_assignment(
    n: int, fraction: float, seed: int, where: float, duplicate: bool
) -> None:
    """Adding (or removing) one record anywhere leaves every other record's side unchanged."""
    features, labels = _records(n, seed)
    position = min(int(where * (n + 1)), n)
    if duplicate:  # the new record may even copy an existing one
        new_x, new_y = features[position % n], labels[position % n]
    else:
        new_x, new_y = np.full(features.shape[1], where, dtype=np.float32), np.int64(7)
    bigger_x = np.insert(features, position, new_x, axis=0)
    bigger_y = np.insert(labels, position, new_y)
    small = holdout_mask(features, labels, fraction, seed)
    big = holdout_mask(bigger_x, bigger_y, fraction, seed)
    np.testing.assert_array_equal(np.delete(big, position), small)
    # so the training sets differ in at most the one record
    train_small = _rows(features[~small])
    train_big = _rows(bigger_x[~big])
    assert len(train_big) - len(train_small) in (0, 1)
    assert all(row in train_big for row in train_small)


def test_record_split_fraction_seed_and_content() -> None:
    features, labels = _records(20000, 3)
    for fraction in (0.1, 0.2, 0.45):
        _, held = record_split(features, labels, fraction, 11)
        assert _near(held.size, 20000, fraction)
        for value in range(5):  # each class loses about `fraction` of its rows
            in_class = labels == value
            assert _near(int(in_class[held].sum()), int(in_class.sum()), fraction)
    a = holdout_mask(features, labels, 0.2, 1)
    assert not np.array_equal(a, holdout_mask(features, labels, 0.2, 2))  # the seed matters
    # the side is a function of content: a permutation of the rows permutes the sides
    order = np.random.default_rng(0).permutation(20000)
    np.testing.assert_array_equal(holdout_mask(features[order], labels[order], 0.2, 1), a[order])
    # and of the label too
    assert not np.array_equal(holdout_mask(features, (labels + 1) % 5, 0.2, 1), a)
    # a larger fraction holds out a superset (the same hashes against a higher threshold)
    assert np.all(holdout_mask(features, labels, 0.3, 1)[a])


@settings(max_examples=200, deadline=None)
@given(fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_holdout_threshold_is_exact(fraction: float) -> None:
    threshold = holdout_threshold(fraction)
    assert Fraction(threshold, 2**64) <= Fraction(fraction) < Fraction(threshold + 1, 2**64)
    assert 0 <= threshold < 2**64


def _insert_har_row(root: Path, row: str, label: int) -> None:
    folder = root / "UCI HAR Dataset" / "train"
    for name, line in (("X_train.txt", row), ("y_train.txt", str(label))):
        path = folder / name
        path.write_text(line + "\n" + path.read_text())


@pytest.mark.parametrize("split", ["train", "all"])
def test_loader_neighbouring_datasets_differ_in_one_training_record(
    tmp_path: Path, split: str
) -> None:
    """load_dataset on D and on D + one record (inserted first): train sets differ in ≤ 1 row."""
    _write_har(tmp_path / "small", n_train=200)
    _write_har(tmp_path / "big", n_train=200)
    new_row = np.linspace(-0.9, 0.9, 561, dtype=np.float32)
    _insert_har_row(tmp_path / "big", "  " + " ".join(f"{v:.7e}" for v in new_row), 4)
    small = load_dataset("har", split=split, data_dir=tmp_path / "small", val_fraction=0.2, seed=3)
    big = load_dataset("har", split=split, data_dir=tmp_path / "big", val_fraction=0.2, seed=3)
    added = 0
    for part in ("train", "val", "test"):
        rows_small = _rows(getattr(small, part).features)
        rows_big = _rows(getattr(big, part).features)
        assert all(row in rows_big for row in rows_small)
        added += len(rows_big) - len(rows_small)
    assert added == 1
    assert len(small.val) > 0 and len(small.train) > len(small.val)



@pytest.mark.parametrize("kind", ["folder", "loop", "dangling"])
def test_a_data_file_that_is_not_a_file_is_named_as_such(kind: str, tmp_path: Path) -> None:
    """A data file's name taken by a folder or a broken link is said to be that, not "missing"; a later candidate
    that is a real file is still found."""
    from dpltm.data.sources import find_file

    path = tmp_path / "digits.csv.gz"
    if kind == "folder":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path)
    else:
        path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(DpltmUserError, match="not a data file"):
        find_file([path, tmp_path / "digits.csv"])
    (tmp_path / "digits.csv").write_text("0")
    assert find_file([path, tmp_path / "digits.csv"]) == tmp_path / "digits.csv"
