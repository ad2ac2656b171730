"""Output files: refused before the work if they cannot or must not be written, locked while a command
writes them, and replaced atomically.

Writing goes to a temporary file in the same directory that is fsynced and then `os.replace`d over the
target: a crash leaves either the old file or the new one, never half of one (open_lth's plain
`torch.save` does not).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from dpltm.errors import USER_ERRNOS, DpltmUserError, os_error_behind
from dpltm.paths import check_not_input, check_path_length


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
