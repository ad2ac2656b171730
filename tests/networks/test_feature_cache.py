"""The feature cache is the user's alone and best effort: a folder others can reach is not used, files are
checked with a key only the user holds, a pipe in place of a file cannot block, and a cache that cannot be
written is one plain note while the run goes on with its features."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from dpltm import feature_cache
from dpltm.feature_cache import feature_cache_dir, features_of


class Front:
    """A front end's test double: features are the first three values, doubled."""
    in_features, out_features = 4, 3

    def settings(self) -> dict[str, str]:
        return {"front": "test double"}

    def __call__(self, records: torch.Tensor) -> torch.Tensor:
        return records[:, :3] * 2


def _records(n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 4, generator=torch.Generator().manual_seed(seed))


def _features(seed: int = 0) -> torch.Tensor:
    feature_cache._recent.clear()  # read the folder, not this process's memory
    return features_of(Front(), _records(seed=seed), feature_cache_dir())


def _note(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one note, on one line
    return err


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(feature_cache, "_recent", OrderedDict())
    monkeypatch.setattr(feature_cache, "_UNWRITABLE", set())
    monkeypatch.setenv("DPLTM_FEATURE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pt"))


@pytest.mark.parametrize("whose", ["open to others", "another user's"])
def test_a_folder_others_can_reach_is_not_used(cache: Path, whose: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cache.mkdir()
    if whose == "open to others":
        cache.chmod(0o777)
    else:
        cache.chmod(0o700)
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(cache).st_uid + 1)
    assert torch.equal(_features(), _records()[:, :3] * 2)
    assert torch.equal(_features(seed=1), _records(seed=1)[:, :3] * 2)  # said once a folder, not once a split
    note = _note(capsys)
    assert note.startswith(f"feature cache not used: {cache} ")
    assert ("chmod 700" if whose == "open to others" else "belongs to another user") in note
    assert "set DPLTM_FEATURE_CACHE to a folder of your own" in note
    assert list(cache.iterdir()) == []  # nothing written, and the folder left as it was
    assert stat.S_IMODE(cache.stat().st_mode) == (0o777 if whose == "open to others" else 0o700)


def test_a_new_folder_its_files_and_its_key_are_the_users_alone(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    first = _features()
    key = cache / feature_cache.KEY_FILE
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in [key, *_entries(cache)]] == [0o600, 0o600]
    assert len(key.read_bytes()) == feature_cache.KEY_BYTES
    assert sorted(p.name for p in cache.iterdir()) == sorted([key.name, _entries(cache)[0].name])  # no temp left
    monkeypatch.setattr(feature_cache, "compute_features", lambda *a, **k: pytest.fail("computed again"))
    assert torch.equal(_features(), first)  # read back with the same key
    assert capsys.readouterr().err == ""


def test_a_file_with_a_consistent_unkeyed_checksum_is_rebuilt(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Whoever lacks the key cannot make a file that passes: a plain SHA-256 of the pieces, as earlier formats
    stored, made consistent with changed features, is a mismatch."""
    good = _features()
    (path,) = _entries(cache)
    body = torch.load(path, weights_only=True)
    body["features"] = body["features"] + 1
    pieces = f"dpltm-feature-pieces:{feature_cache.CHECKSUM_PIECE}:".encode() + hashlib.sha256(
        feature_cache._bytes(body["features"])).digest()  # one piece: a small file
    body["hmac"] = body["sha256"] = hashlib.sha256(pieces).hexdigest()  # under either name
    torch.save(body, path)
    assert torch.equal(_features(), good)
    assert _note(capsys) == f"feature cache {path} is damaged (checksum mismatch): computing the features again\n"
    assert torch.equal(torch.load(path, weights_only=True)["features"], good)  # the rebuilt file


def test_a_pipe_in_place_of_an_entry_does_not_block_and_is_replaced(cache: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    good = _features()
    (path,) = _entries(cache)
    path.unlink()
    os.mkfifo(path, 0o600)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(_features()), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked on the pipe: let it go before failing
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading the cache blocked on a pipe")
    assert torch.equal(got[0], good)
    assert _note(capsys) == f"feature cache {path} is damaged (not a regular file): computing the features again\n"
    assert stat.S_ISREG(path.lstat().st_mode)  # the rebuilt file replaced the pipe


@pytest.mark.parametrize(("code", "said"), [(errno.ENOSPC, "no space left on the device"),
                                            (errno.EDQUOT, "disk quota exceeded")])
def test_a_failed_write_is_one_plain_note(cache: Path, code: int, said: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """torch's zip writer raises a RuntimeError once the file's write has failed with an OSError."""
    def save(body: object, handle: object) -> None:
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(torch, "save", save)
    assert torch.equal(_features(), _records()[:, :3] * 2)
    assert torch.equal(_features(seed=1), _records(seed=1)[:, :3] * 2)
    note = _note(capsys)  # once a folder, not once a split
    assert note.startswith(f"feature cache not written ({cache}/") and note.endswith(f": {said}); the features "
                                                                                     "are not kept\n")
    assert [p.name for p in cache.iterdir()] == [feature_cache.KEY_FILE]  # no temp file left


def test_a_file_size_limit_is_one_plain_note(cache: Path) -> None:
    """For real: a process whose file-size limit is below the file's size (SIGXFSZ ignored, as many shells
    and services leave it) gets EFBIG, and torch's zip writer a RuntimeError after it."""
    child = """if True:
        import resource, signal, torch
        from dpltm.feature_cache import feature_cache_dir, features_of
        from tests.networks.test_feature_cache import Front, _records
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        records = _records(2000)
        assert torch.equal(features_of(Front(), records, feature_cache_dir()), records[:, :3] * 2)
    """
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"feature cache not written ({cache}/")
    assert run.stderr.endswith(": file too large for the file-size limit); the features are not kept\n")
    assert [p.name for p in cache.iterdir()] == [feature_cache.KEY_FILE]


@pytest.mark.parametrize("where", ["the folder", "a folder above"])
def test_a_cache_folder_that_is_a_file_says_so(tmp_path: Path, cache: Path, where: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cache.write_text("not a folder")
    if where == "a folder above":
        monkeypatch.setenv("DPLTM_FEATURE_CACHE", str(cache / "features"))
    assert torch.equal(_features(), _records()[:, :3] * 2)
    assert _note(capsys) == (f"feature cache not written: {cache} is a file, not a folder; remove it or set "
                             "DPLTM_FEATURE_CACHE to a folder\n")
