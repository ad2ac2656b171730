"""Atomic, versioned checkpoints that refuse foreign files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpltm import checkpoint
from dpltm.checkpoint import FORMAT_VERSION, load_checkpoint, save_atomic
from dpltm.errors import DpltmUserError


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    payload = {"masks": {"w": torch.ones(2, 3, dtype=torch.bool)}, "x": [1.5, None, "s"]}
    save_atomic(payload, path, "tickets")
    body = load_checkpoint(path, "tickets")
    assert body["format_version"] == FORMAT_VERSION and body["kind"] == "tickets"
    assert torch.equal(body["masks"]["w"], payload["masks"]["w"]) and body["x"] == [1.5, None, "s"]
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temp files left


def test_crash_during_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.pt"
    save_atomic({"v": 1}, path, "tickets")
    before = path.read_bytes()

    def exploding_save(obj, handle):  # type: ignore[no-untyped-def]
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", exploding_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic({"v": 2}, path, "tickets")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_foreign_and_damaged_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(DpltmUserError, match="not a readable dpltm checkpoint"):
        load_checkpoint(junk, "tickets")
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(DpltmUserError, match="not a dpltm checkpoint"):
        load_checkpoint(foreign, "tickets")
    with pytest.raises(DpltmUserError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt", "tickets")


def test_pickled_objects_are_not_executed(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("owned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": "dpltm", "kind": "tickets", "format_version": 1, "x": Evil()}, path)
    with pytest.raises(DpltmUserError, match="not a readable"):
        load_checkpoint(path, "tickets")


def test_wrong_kind_and_version(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    save_atomic({}, path, "model")
    with pytest.raises(DpltmUserError, match="expected tickets"):
        load_checkpoint(path, "tickets")
    torch.save({"format": "dpltm", "kind": "tickets", "format_version": 99}, path)
    with pytest.raises(DpltmUserError, match="format 99"):
        load_checkpoint(path, "tickets")


def test_unwritable_output_fails_early(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if checkpoint.os.access(locked, checkpoint.os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(DpltmUserError, match="not writable"):
            checkpoint.check_writable(locked / "x.pt")
    finally:
        locked.chmod(0o700)
    with pytest.raises(DpltmUserError, match="is a directory"):
        checkpoint.check_writable(tmp_path)
