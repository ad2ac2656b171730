"""Checkpoint files: written atomically, read with `weights_only=True`, versioned.

A file is a dict of tensors and plain values (no pickled classes), so `torch.load` can read
it without executing code. Writing goes to a temporary file in the same directory that is
fsynced and then `os.replace`d over the target: a crash leaves either the old file or the new
one, never half of one (open_lth's plain `torch.save` does not).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from dpltm.artefacts.format import FORMAT_VERSION, KINDS, OLDEST_READABLE, current_parameter_names, refusal
from dpltm.errors import USER_ERRNOS, DpltmUserError, os_error_behind
from dpltm.paths import check_not_input, check_path_length

SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "run": {"model": dict, "optimizer": dict, "masks": dict, "dataset_name": str, "dataset_size": int,
            "settings": dict, "segments": list, "epochs_done": int, "history": list},
}
"""Keys a library run must hold (dotted paths into nested dicts) and their types: a file that claims to
be a dpltm checkpoint but lacks its body is refused in one line, not a KeyError. The other kinds are
typed artefacts, checked by their own `from_dict` (`ARTEFACTS`)."""
ARTEFACTS = {"tickets": "TicketSet", "ticket": "Winner", "model": "TrainedModel"}
"""The kinds read as typed artefacts (dpltm.artefacts), each checked field by field when loaded."""


def _lookup(body: dict[str, Any], dotted: str) -> Any:
    value: Any = body
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _check_schema(body: dict[str, Any], kind: str, path: Path) -> None:
    for key, expected in SCHEMA[kind].items():
        try:
            value = _lookup(body, key)
        except KeyError:
            raise DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: it lacks '{key}'") from None
        types_ = expected if isinstance(expected, tuple) else (expected,)
        if float in types_:
            types_ = (*types_, int)
        if isinstance(value, bool) and bool not in types_ or not isinstance(value, types_):
            raise DpltmUserError(f"{path} is a damaged '{kind}' checkpoint: '{key}' has the wrong type")


def prepare_output(path: Path, *, overwrite: bool, inputs: Sequence[Path | None] = (),
                   option: str = "--out", checkpoint: bool = False) -> None:
    """Before any work: refuse an output that would destroy an input or an existing result.

    An output equal to one of the command's inputs is always refused (the input would be lost);
    an existing output is replaced only with `--overwrite`. `checkpoint`: the command writes a PyTorch
    checkpoint (`check_checkpoint_name`).
    """
    check_path_length(path, option)
    check_no_link_loop(path, option)
    if path.is_symlink():  # written through (write_atomic): the target is what must exist and be writable
        target = written_path(path)
        if not target.exists():
            raise DpltmUserError(f"{option} {path} is a symbolic link to {target}, which does not exist: give the "
                                 "file's own path")
        check_writable(target)
    if checkpoint:
        check_checkpoint_name(path, option)
    for source in inputs:
        if source is not None and same_file(path, source):
            raise DpltmUserError(f"{option} {path} is also this command's input: write the result elsewhere")
    check_not_input(path, option)
    if path.exists() and not path.is_dir() and not path.is_file():  # before --overwrite is offered: it would not help
        raise DpltmUserError(f"output {path} is not a regular file (a device, pipe or socket): write to a file")
    if path.exists() and not path.is_dir() and not overwrite:
        raise DpltmUserError(f"{path} already exists: pass --overwrite to replace it, or {option} to write elsewhere")
    check_writable(path)


def check_checkpoint_name(path: Path, option: str = "--out") -> None:
    """Refuse a PyTorch checkpoint under a `.safetensors` name: every reader (inspect, predict, train
    --ticket) would take it for a safetensors file and fail to open it, after the run had spent its
    privacy budget writing it."""
    if path.suffix.lower() == ".safetensors":
        raise DpltmUserError(f"{option} {path} names a safetensors file, but this command writes a PyTorch "
                             "checkpoint: give a .pt name (`dpltm export` makes the .safetensors file)")
    if path.suffix.lower() in OTHER_KINDS:
        raise DpltmUserError(f"{option} {path} names a {OTHER_KINDS[path.suffix.lower()]} file, but this command "
                             "writes a PyTorch checkpoint: give a .pt name")


OTHER_KINDS = {".csv": "CSV", ".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".png": "PNG", ".pdf": "PDF",
               ".txt": "text"}
"""Suffixes of the files other commands write or read: a checkpoint under one would be taken for one."""


def check_text_output_name(path: Path, kind: str, option: str = "--out") -> None:
    """Refuse a text output (`predict`'s CSV) under a checkpoint's or an export's name: readers would take it
    for one."""
    if path.suffix.lower() in (".pt", ".pth", ".ckpt", ".safetensors"):
        raise DpltmUserError(f"{option} {path} names a model file, but this command writes {kind}: give a .csv name")


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (resolved, or by inode when both exist)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # RuntimeError: a loop of symbolic links
        return False


@contextlib.contextmanager
def output_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on writing `path` for the duration of a command.

    Two dpltm processes writing the same output at once (say two `generate` runs with different
    seeds) would silently replace each other's work: the second is refused in one line. Once the
    lock is held, temp files of `path` left by a killed run (`.NAME.*.tmp`) are stale and removed.
    The lock is `flock` on a hidden `.NAME.lock` beside the output, removed on release.
    """
    check_writable(path)
    _make_parent(path)
    lock_path = path.parent / f".{path.name}.lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a folder that takes no files (/proc, /sys): the user's to change
            if exc.errno in USER_ERRNOS:
                raise
            raise DpltmUserError(f"cannot write beside {path} ({exc.strerror}): write elsewhere") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DpltmUserError(f"another dpltm process is writing {path}: wait, or write elsewhere") from None
            raise
        try:  # the lock file may have been unlinked by its previous holder between open and flock
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)


def write_text_atomic(text: str, path: Path) -> None:
    """A text file (e.g. a metrics log) written with the same temp-file-then-rename rule."""
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Bytes (an exported model, a figure) written with the same temp-file-then-rename rule."""
    write_atomic(path, lambda handle: handle.write(data))


def written_path(path: Path) -> Path:
    """The file a write to `path` replaces: a symbolic link's target (the link is kept), else `path` itself."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write to a temp file beside `path`, fsync, then `os.replace`: a crash or a signal leaves
    either the old file or the new one, never half of one, and no temp file behind. A symbolic link
    is written through (its target replaced, the link kept): replacing the link itself would turn
    `/dev/stdout` or a user's link into a plain file and leave the file it named as it was."""
    path = written_path(path)
    check_not_input(path)
    check_writable(path)
    _make_parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        reason = _write_failure(exc, path.parent)
        if reason is not None:  # a full disk, a quota: the user's to fix, in one line naming the file
            raise DpltmUserError(f"cannot write {path}: {reason}") from None
        raise


def _write_failure(exc: BaseException, folder: Path) -> str | None:
    """Why a write failed, where it is the file system's doing: an OS error (ENOSPC, EFBIG, EDQUOT, …), or torch.save's
    zip writer, which reports a short write as a RuntimeError ("unexpected pos", "file write failed") raised while
    handling the OS error (its `__context__`), which says what happened: a full disk, a quota, a file-size limit."""
    short_write = isinstance(exc, RuntimeError) and ("inline_container" in str(exc) or "write failed" in str(exc))
    cause = os_error_behind(exc) if isinstance(exc, OSError) or short_write else None
    if cause is not None and cause.errno in USER_ERRNOS:
        return cause.strerror or str(cause)
    if short_write:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        return ("the write stopped short" + ("" if free is None else f" ({free} bytes free on its file system)")
                + ": a full disk, a disk quota or a file-size limit (ulimit -f); free space or write elsewhere")
    return None


def check_no_link_loop(path: Path, option: str = "--out") -> None:
    """A path whose symbolic links lead back to themselves names no file (Path.resolve raises RuntimeError up to
    Python 3.12; from 3.13 it returns, and stat fails with ELOOP)."""
    loop = False
    try:
        path.resolve()
    except (RuntimeError, OSError):
        loop = True
    if not loop and path.is_symlink():
        try:
            os.stat(path)
        except OSError as error:
            loop = error.errno == errno.ELOOP
    if loop:
        raise DpltmUserError(f"{option} {path} is a loop of symbolic links: give another path")


def check_writable(path: Path) -> None:
    """Fail before any work is done if the output cannot be written. Creates nothing: the
    nearest existing ancestor must be a writable directory (missing folders are made on save)."""
    check_path_length(path)
    check_no_link_loop(path)
    if path.exists() and path.is_dir():
        raise DpltmUserError(f"output {path} is a directory")
    if path.exists() and not path.is_file():  # the write renames a file over it: /dev/null would become one
        raise DpltmUserError(f"output {path} is not a regular file (a device, pipe or socket): write to a file")
    ancestor = path.parent if str(path.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DpltmUserError(f"cannot create output directory {path.parent}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise DpltmUserError(f"output directory {ancestor} is not writable")
    check_storage(ancestor)


def check_storage(folder: Path) -> None:
    """Refuse a folder on a read-only file system, or in the kernel's /proc or /sys (`os.access` says yes to root
    there, and the write itself fails): a run must fail before its work, not when it saves. Reads the file
    system's statistics only; creates nothing."""
    resolved = folder.resolve()
    kernel = next((root for root in KERNEL_FILE_SYSTEMS if resolved == root or root in resolved.parents), None)
    if kernel is not None:
        raise DpltmUserError(f"cannot write in {folder}: {kernel} is the kernel's, not storage")
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows): the save reports its own failure
        return
    if read_only:
        raise DpltmUserError(f"cannot write in {folder}: its file system is read-only")


KERNEL_FILE_SYSTEMS = (Path("/proc"), Path("/sys"))


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DpltmUserError(f"cannot create output directory {path.parent}: {exc.strerror}") from None


def save_atomic(payload: dict[str, Any], path: Path, kind: str) -> None:
    """Write `payload` (plus format header and the library versions that made it) to `path` atomically."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind}")
    from dpltm.provenance import environment

    # the versions of *this* write: a resumed ticket file says what finished it
    body = {"format": "dpltm", "kind": kind, "format_version": FORMAT_VERSION, **payload,
            "environment": environment()}
    write_atomic(path, lambda handle: torch.save(body, handle))


def holds_checkpoint_of_kind(path: Path, kind: str) -> bool:
    """Whether `path` is a dpltm checkpoint of `kind`, from its header alone (tensors memory-mapped, not read):
    the cheap look a save takes before replacing a file, unlike `load_checkpoint`'s full check."""
    if not path.is_file():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a torch file, or a damaged one: either way not one to replace silently
        return False
    return isinstance(body, dict) and body.get("format") == "dpltm" and body.get("kind") == kind


def load_checkpoint(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """Read a dpltm checkpoint of the expected kind(s), or explain in one line why not. Every kind is
    checked field by field (a typed artefact by its `from_dict`, a library run by `SCHEMA`)."""
    body = _read(path, kind)
    found = body["kind"]
    if found in ARTEFACTS:
        _artefact(found).from_dict(body, path)
    else:
        _check_schema(body, found, path)
    return body


def _artefact(kind: str) -> Any:
    import dpltm.artefacts

    return getattr(dpltm.artefacts, ARTEFACTS[kind])


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object of that length."""
    try:
        with path.open("rb") as handle:
            head = handle.read(9)
        return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size
    except OSError:
        return False


def _why_unreadable(path: Path, exc: Exception) -> str:
    """torch.load's failure in the user's terms (its own text speaks of `weights_only` and pickle opcodes)."""
    import pickle

    try:
        with path.open("rb") as handle:
            head = handle.read(2)
    except OSError as err:
        return err.strerror or type(err).__name__
    if head != b"PK":  # torch.save's zip format
        return "not a PyTorch save file"
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds Python objects beyond tensors and plain data, which dpltm never unpickles"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(first) > 100:  # cut at a word, and say so
        first = first[:100].rsplit(" ", 1)[0] + " …"
    return f"a damaged PyTorch save file: {first}"


def _damaged_entry(path: Path) -> str | None:
    """The first entry of a zip-format checkpoint (torch.save's format) whose bytes fail their CRC-32, or None.
    torch.load reads the tensors without checking it: one flipped byte would load as other weights."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except Exception:  # not a zip, unreadable, or a foreign one (encrypted, unknown compression): torch.load says
        return None


def _read(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """The body of a dpltm checkpoint of a readable format and of the expected kind(s), unchecked."""
    kinds = (kind,) if isinstance(kind, str) else kind
    from dpltm.paths import check_input_file

    check_input_file(path, "checkpoint")
    if _is_safetensors(path):
        raise DpltmUserError(f"{path} is a safetensors file (a `dpltm export`), not a dpltm checkpoint: give the "
                             ".pt file it was made from")
    damaged = _damaged_entry(path)
    if damaged is not None:
        raise DpltmUserError(f"{path} is damaged: its entry {damaged} fails its CRC-32 check (a changed or corrupted "
                             "file); use an intact copy")
    try:
        with warnings.catch_warnings():  # torch's warnings about a foreign file's pickle protocol: the error says it
            warnings.simplefilter("ignore")
            body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for foreign or damaged files
        raise DpltmUserError(f"{path} is not a readable dpltm checkpoint ({_why_unreadable(path, exc)})") from None
    if not isinstance(body, dict) or body.get("format") != "dpltm":
        raise DpltmUserError(f"{path} is not a dpltm checkpoint")
    version, found = body.get("format_version"), body.get("kind")
    oldest = OLDEST_READABLE.get(found, FORMAT_VERSION) if isinstance(found, str) else FORMAT_VERSION
    readable = isinstance(version, int) and not isinstance(version, bool) and oldest <= version <= FORMAT_VERSION
    if not readable:
        raise DpltmUserError(refusal(path, found, version))
    if found not in kinds:
        raise DpltmUserError(f"{path} holds a '{found}' checkpoint, expected {' or '.join(kinds)}")
    for key in ("theta0", "state_dict"):  # files written before the networks' parameters were renamed
        if found != "run" and isinstance(body.get(key), dict):
            body[key] = current_parameter_names(body[key], f"{path}'s {key}")
    return body


def load_artefact(path: Path, kinds: tuple[str, ...]) -> Any:
    """A checkpoint of one of `kinds`, as its typed artefact (`dpltm.artefacts`), or as the checked body
    of a library run (kind "run", not an artefact)."""
    body = _read(path, kinds)
    if body["kind"] in ARTEFACTS:
        return _artefact(body["kind"]).from_dict(body, path)
    _check_schema(body, body["kind"], path)
    return body


def load_ticket_set(path: Path) -> Any:
    """A `dpltm generate` checkpoint as a checked `dpltm.artefacts.TicketSet`; a winner (which needs no
    selection) is refused in one line that says how to train it."""
    body = _read(path, ("tickets", "ticket"))
    artefact = _artefact(body["kind"]).from_dict(body, path)
    if body["kind"] == "ticket":
        what = "a private ticket (generate --private)" if artefact.is_private_ticket else "a winner"
        raise DpltmUserError(f"{path} is {what}, not a ticket set: it needs no selection; train it with "
                             f"`dpltm train --ticket {path}`")
    return artefact


def load_winner(path: Path) -> Any:
    """A `dpltm select` (or `generate --private`) checkpoint as a checked `dpltm.artefacts.Winner`; a
    ticket set is refused in one line that says to select from it first."""
    body = _read(path, ("ticket", "tickets"))
    artefact = _artefact(body["kind"]).from_dict(body, path)
    if body["kind"] == "tickets":
        raise DpltmUserError(f"{path} is a ticket set: pick a winner with `dpltm select --tickets {path}` first")
    return artefact


def load_trained_model(path: Path) -> Any:
    """A `dpltm train` checkpoint as a checked `dpltm.artefacts.TrainedModel`."""
    from dpltm.artefacts import TrainedModel

    return TrainedModel.from_dict(_read(path, "model"), path)
