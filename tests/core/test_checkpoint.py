"""Atomic, versioned checkpoints that refuse foreign files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dpltm import checkpoint, outputs
from dpltm.artefacts.format import FORMAT_VERSION
from dpltm.checkpoint import load_checkpoint, save_atomic
from dpltm.errors import DpltmUserError
from tests.core.bodies import ticket_set


def tickets_body(**extra: object) -> dict[str, object]:
    """The smallest body the 'tickets' schema accepts."""
    return {"data": {"dataset": "digits", "split": "train", "fingerprint": "f"}, "architecture": {},
            "theta0": {}, "config": {}, "privacy": {}, "tickets": [], "complete": True, "seed": 0, **extra}


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    payload = ticket_set().to_dict()
    save_atomic(payload, path, "tickets")
    body = load_checkpoint(path, "tickets")
    assert body["format_version"] == FORMAT_VERSION and body["kind"] == "tickets"
    masks, saved = body["tickets"][1]["masks"], payload["tickets"][1]["masks"]
    assert all(torch.equal(masks[k], saved[k]) for k in saved) and body["data"] == payload["data"]
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temp files left


def test_files_from_before_the_plain_modules_load_under_todays_names(tmp_path: Path) -> None:
    """θ0 keys of the old `layers` dict (layers.hidden_0.weight), which files before format 4 may hold, are read as
    today's (hidden.0.weight)."""
    from dpltm.artefacts.format import current_parameter_names
    from dpltm.checkpoint import load_ticket_set

    assert current_parameter_names({"layers.hidden_0.weight": 1, "layers.conv_1.bias": 2, "layers.project.weight": 3,
                                    "layers.output.bias": 4, "mask_hidden_0_weight": 5, "hidden.1.bias": 6}) == {
        "hidden.0.weight": 1, "conv.1.bias": 2, "project.weight": 3, "output.bias": 4, "mask_hidden_0_weight": 5,
        "hidden.1.bias": 6}
    payload = {**ticket_set().to_dict(), "format_version": 3}
    today = dict(payload["theta0"])
    old = {"layers." + k.rsplit(".", 1)[0].replace(".", "_") + "." + k.rsplit(".", 1)[1]: v for k, v in today.items()}
    assert set(old) == {"layers.hidden_0.weight", "layers.hidden_0.bias", "layers.output.weight", "layers.output.bias"}
    torch.save({**payload, "theta0": old}, tmp_path / "old.pt")
    loaded = load_ticket_set(tmp_path / "old.pt")
    assert loaded.theta0.keys() == today.keys() and all(torch.equal(loaded.theta0[k], today[k]) for k in today)
    mixed = {**today, "layers.output.weight": today["output.weight"] + 7}
    torch.save({**payload, "theta0": mixed}, tmp_path / "mix.pt")
    with pytest.raises(DpltmUserError, match="holds layers.output.weight and output.weight"):
        load_ticket_set(tmp_path / "mix.pt")


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
    with pytest.raises(DpltmUserError, match=r"not a readable dpltm checkpoint \(not a PyTorch save file\)"):
        load_checkpoint(junk, "tickets")
    pickled = tmp_path / "pickled.pt"
    torch.save({"format": "dpltm", "payload": Path("objects")}, pickled)  # more than tensors and plain data
    with pytest.raises(DpltmUserError, match="Python objects beyond tensors and plain data") as caught:
        load_checkpoint(pickled, "tickets")
    assert "weights_only" not in str(caught.value)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(pickled.read_bytes()[:40])
    with pytest.raises(DpltmUserError, match="a damaged PyTorch save file"):
        load_checkpoint(truncated, "tickets")
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
    # format 1 (dpltm 0.1.0 before the redesign: other config hashes, no required activation): refused
    torch.save({"format": "dpltm", "kind": "tickets", "format_version": 1, "config_hash": "48e9bd96a4f0d481"}, path)
    with pytest.raises(DpltmUserError, match=r"has checkpoint format 1, this dpltm reads format 4$"):
        load_checkpoint(path, "tickets")


def test_unwritable_output_fails_early(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if outputs.os.access(locked, outputs.os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(DpltmUserError, match="not writable"):
            outputs.check_writable(locked / "x.pt")
    finally:
        locked.chmod(0o700)
    with pytest.raises(DpltmUserError, match="is a directory"):
        outputs.check_writable(tmp_path)


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """The write renames a temp file over the output: `--out /dev/null --overwrite` (run as root) once
    replaced /dev/null with a checkpoint. Devices and pipes are refused before any work."""
    fifo = tmp_path / "pipe"
    outputs.os.mkfifo(fifo)
    for target in (Path("/dev/null"), fifo):
        with pytest.raises(DpltmUserError, match="not a regular file"):
            outputs.prepare_output(target, overwrite=True)
    assert Path("/dev/null").is_char_device()


@pytest.mark.parametrize(("kind", "body", "missing"), [
    ("tickets", {}, "'data'"),
    ("tickets", tickets_body(data={"dataset": "digits"}), "'data.split'"),
    ("tickets", tickets_body(tickets=[{"round": 0}]), "'tickets[0].masks'"),
    ("tickets", tickets_body(complete="yes"), "'complete' has the wrong type"),
    ("ticket", {}, "'architecture'"),
    ("model", {"architecture": {}}, "'state_dict'"),
])
def test_a_headed_file_without_its_body_is_refused_in_one_line(tmp_path: Path, kind: str, body: dict,
                                                               missing: str) -> None:
    path = tmp_path / "x.pt"
    save_atomic(body, path, kind)
    with pytest.raises(DpltmUserError, match=f"damaged .{kind}. checkpoint.*{re.escape(missing)}"):
        load_checkpoint(path, kind)


def test_a_dash_is_refused_as_typed_and_dot_slash_dash_names_a_file() -> None:
    """`--out -` means standard output to many tools; dpltm's outputs are files: refused as typed, before any other
    check. `./-` is how a file named '-' is written (Click normalises it to `-`, so the check reads the argument)."""
    from dpltm.cli_runtime import folder_named_as_output

    message = "--out - : this command writes a file; give a path, '-' (standard output) is not supported"
    for argv in (["select", "--best", "--out", "-"], ["select", "--out=-"], ["train", "--out", "-", "--eps2", "1"]):
        assert folder_named_as_output(argv) == message
    assert folder_named_as_output(["select", "--best", "--out", "./-"]) is None


def test_prepare_output_protects_inputs_and_existing_results(tmp_path: Path) -> None:
    source = tmp_path / "t.pt"
    source.write_bytes(b"tickets")
    with pytest.raises(DpltmUserError, match="also this command's input"):
        outputs.prepare_output(tmp_path / "." / "t.pt", overwrite=True, inputs=[source])
    with pytest.raises(DpltmUserError, match="already exists: pass --overwrite"):
        outputs.prepare_output(source, overwrite=False)
    outputs.prepare_output(source, overwrite=True)
    outputs.prepare_output(tmp_path / "new.pt", overwrite=False, inputs=[source, None])
    assert source.read_bytes() == b"tickets"


def test_output_lock_refuses_a_second_writer_and_clears_stale_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "t.pt"
    stale = tmp_path / ".t.pt.abc123.tmp"
    stale.write_bytes(b"left by a killed run")
    other = tmp_path / ".u.pt.abc123.tmp"
    other.write_bytes(b"another output's")
    with outputs.output_lock(target):
        assert not stale.exists() and other.exists()
        with pytest.raises(DpltmUserError, match="another dpltm process is writing"):
            with outputs.output_lock(target):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".u.pt.abc123.tmp"]  # the lock file is gone
    with outputs.output_lock(target):  # free again
        pass


def test_write_text_atomic(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "metrics.csv"
    outputs.write_text_atomic("a,b\n1,2\n", path)
    assert path.read_text() == "a,b\n1,2\n"
    assert [p.name for p in path.parent.iterdir()] == ["metrics.csv"]


def test_a_long_message_keeps_its_reason() -> None:
    """A 4200-character path must not push the reason out of the one line: the middle is cut, not the end."""
    from dpltm.errors import MAX_MESSAGE_CHARS, one_line

    message = f"cannot write {'x' * 4200}/m.pt: File name too long"
    line = one_line(message)
    assert line.startswith("cannot write xxx") and line.endswith("m.pt: File name too long")
    assert f"({len(message) - MAX_MESSAGE_CHARS} more characters)" in line
    assert len(line) < MAX_MESSAGE_CHARS + 60 and "\n" not in line
    assert one_line("short\nline") == "short\\nline"


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),  # torch.save, disk full
    OSError(28, "No space left on device"),
])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(tmp_path: Path, failure: Exception) -> None:
    from dpltm.errors import DpltmUserError
    from dpltm.outputs import write_atomic

    def write(handle: object) -> None:
        raise failure

    target = tmp_path / "m.pt"
    with pytest.raises(DpltmUserError, match=f"cannot write {target}: ") as caught:
        write_atomic(target, write)
    assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not the user's: it propagates as it is
        write_atomic(target, lambda handle: (_ for _ in ()).throw(RuntimeError("a bug")))


def test_a_file_size_limit_is_named_as_such_not_guessed_a_full_disk(tmp_path: Path) -> None:
    """Under `ulimit -f` torch.save's zip writer raises a RuntimeError while handling EFBIG: the message says the
    file is too large (the OS's words), not "no space left?" beside the bytes free."""
    import subprocess
    import sys

    script = f"""
import resource, signal, torch
from pathlib import Path
from dpltm.checkpoint import save_atomic
from dpltm.errors import DpltmUserError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    save_atomic({{"x": torch.zeros(1 << 16)}}, Path({str(tmp_path / 'm.pt')!r}), "model")
except DpltmUserError as exc:
    print(exc)
"""
    said = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout.strip()
    assert said == f"cannot write {tmp_path / 'm.pt'}: File too large", said
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", ["EPERM", "EACCES"])
def test_a_file_the_user_may_not_replace_is_one_line_and_kept(code: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An immutable (chattr +i) or protected output: the rename fails; the error names the file in one line, the
    old file stays and no temp file is left."""
    import errno
    import os

    from dpltm.outputs import write_atomic

    target = tmp_path / "kept.pt"
    target.write_bytes(b"old")

    def refused(src: str, dst: str) -> None:
        raise PermissionError(getattr(errno, code), os.strerror(getattr(errno, code)), src, None, dst)

    monkeypatch.setattr(outputs.os, "replace", refused)
    with pytest.raises(DpltmUserError, match=f"cannot write {re.escape(str(target))}: "):
        write_atomic(target, lambda handle: handle.write(b"new"))
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["kept.pt"]


def test_an_output_name_leaves_room_for_its_temporary_file(tmp_path: Path) -> None:
    """A legal 253-byte name would fail only at the write (the temp file's name adds 14 bytes): refused up front,
    saying how long a name may be; the longest allowed name writes."""
    import os

    from dpltm.paths import WRITE_NAME_EXTRA, check_path_length

    name_max = os.pathconf(str(tmp_path), "PC_NAME_MAX")
    longest = tmp_path / ("x" * (name_max - WRITE_NAME_EXTRA - 3) + ".pt")
    with pytest.raises(DpltmUserError, match=f"use at most {name_max - WRITE_NAME_EXTRA}"):
        check_path_length(tmp_path / ("x" * (name_max - 5) + ".pt"))
    check_path_length(tmp_path / ("x" * (name_max - 5) + ".pt"), file=False)  # a folder's name: no temp beside it
    outputs.write_atomic(longest, lambda handle: handle.write(b"x"))
    assert longest.read_bytes() == b"x"


def test_a_symbolic_link_output_is_written_through(tmp_path: Path) -> None:
    """The link stays a link and its target gets the bytes, dangling or not (replacing the link would turn
    /dev/stdout or a user's link into a plain file)."""
    import os

    target, link = tmp_path / "real.pt", tmp_path / "link.pt"
    os.symlink(target, link)  # dangling: the write creates the target
    outputs.write_atomic(link, lambda handle: handle.write(b"one"))
    assert link.is_symlink() and target.read_bytes() == b"one"
    outputs.write_atomic(link, lambda handle: handle.write(b"two"))
    assert link.is_symlink() and target.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pt", "real.pt"]


def test_a_symbolic_link_output_is_checked_where_it_will_be_written(tmp_path: Path) -> None:
    """prepare_output checks the link's target before any work: a dangling link is refused (dpltm would create
    files wherever it points), a link to an existing file needs --overwrite like the file itself."""
    import os

    from dpltm.outputs import prepare_output

    dangling = tmp_path / "dangling.pt"
    os.symlink(tmp_path / "nowhere" / "x.pt", dangling)
    with pytest.raises(DpltmUserError, match="which does not exist"):
        prepare_output(dangling, overwrite=True)
    (tmp_path / "real.pt").write_bytes(b"old")
    link = tmp_path / "link.pt"
    os.symlink(tmp_path / "real.pt", link)
    with pytest.raises(DpltmUserError, match="already exists"):
        prepare_output(link, overwrite=False)
    prepare_output(link, overwrite=True)
    assert not (tmp_path / "nowhere").exists()
