"""Where data and outputs live. All path decisions are made here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path

from dpltm.errors import DpltmUserError

DATA_DIR_ENV = "DPLTM_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def default_data_dirs() -> list[Path]:
    """Candidates for `../shared/data`, relative to the working directory and to the checkout."""
    return [Path.cwd().parent / "shared" / "data", _REPO_ROOT.parent / "shared" / "data"]


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """The data root: the explicit option, then $DPLTM_DATA_DIR, then ../shared/data if it exists."""
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        source = "--data-dir"
        check_path_length(root, "--data-dir", file=False)
    elif os.environ.get(DATA_DIR_ENV):
        root = Path(os.environ[DATA_DIR_ENV]).expanduser()
        source = f"${DATA_DIR_ENV}"
    else:
        for candidate in default_data_dirs():
            if candidate.is_dir():
                return candidate
        raise DpltmUserError(
            f"no data directory: pass --data-dir or set ${DATA_DIR_ENV} "
            f"(the default ../shared/data does not exist)"
        )
    if not root.is_dir():
        what = "exists but is not a directory" if root.exists() else "does not exist"
        raise DpltmUserError(f"data directory {root} (from {source}) {what}")
    return root


def user_cache_dir(kind: str, env: str) -> Path:
    """A cache folder of the user's: `$env` when set, else ``$XDG_CACHE_HOME/dpltm/<kind>`` (default
    ``~/.cache/dpltm/<kind>``), where torch and torchvision keep theirs."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpltm" / kind


def default_checkpoint_dir() -> Path:
    """Outputs go to ./checkpoints unless the user says otherwise."""
    return Path("checkpoints")


def check_input_file(path: Path, what: str) -> None:
    """Before reading: `path` must be an existing regular file. A FIFO or a device would block
    the read (or never end), a directory cannot be read: each is refused in one line."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DpltmUserError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise DpltmUserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise DpltmUserError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise DpltmUserError(f"{what} {path} is not a regular file (a pipe or a device): give a file")


_inputs_read: list[Path] = []
"""The data files this command has read (`note_input`): no output may replace one of them."""


def note_input(path: Path) -> None:
    """Record that the command reads `path` (a raw data file), so no output can replace it."""
    _inputs_read.append(path)


def forget_inputs() -> None:
    """A new command starts (the CLI calls this): earlier commands' inputs no longer count."""
    _inputs_read.clear()


def check_not_input(target: Path, option: str = "--out") -> None:
    """Refuse to write `target` if it is a data file this command read (even with --overwrite:
    the input would be lost). Compared resolved, and by inode when both exist (a hard link)."""
    for source in _inputs_read:
        try:
            same = target.resolve() == source.resolve() or (
                target.exists() and source.exists() and os.path.samefile(target, source))
        except (OSError, RuntimeError):  # RuntimeError: a loop of symbolic links (refused by the output checks)
            same = False
        if same:
            raise DpltmUserError(f"{option} {target} is also this command's input (the data file {source}): "
                                 "write the result elsewhere")


def names_stdout(path: str | os.PathLike[str], option: str = "--out") -> str | None:
    """The refusal of `-` as an output, else None. To many tools `-` means standard output, but every dpltm output is
    a file (a checkpoint, a CSV, a figure), written atomically beside its name: `-` would make a file named '-'.
    Checked on the argument as typed (`./-` names a file '-', and Click normalises it to `-`)."""
    if os.fspath(path) != "-":
        return None
    return f"{option} - : this command writes a file; give a path, '-' (standard output) is not supported"


WRITE_NAME_EXTRA = len(".") + len(".XXXXXXXX.tmp")
"""Bytes the longest name written beside an output adds to its name: the temp file `.{name}.XXXXXXXX.tmp`
(`dpltm.outputs.write_atomic`; the lock `.{name}.lock` is shorter)."""


def check_path_length(path: Path, what: str = "output", file: bool = True) -> None:
    """Refuse a path the file system cannot hold (a part longer than its NAME_MAX, usually 255
    bytes, or the whole longer than PATH_MAX) before any work, instead of failing on the write. A
    `file` written atomically needs room in its folder for its temp file's longer name too."""
    name_max, path_max = 255, 4096
    try:
        name_max = os.pathconf("/", "PC_NAME_MAX")
        path_max = os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        pass
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise DpltmUserError(f"{what} {path}: the name {part[:40]}… is {len(os.fsencode(part))} bytes long; "
                                 f"the file system allows {name_max}")
    name = os.fsencode(path.name)
    if file and path.name and len(name) + WRITE_NAME_EXTRA > name_max:
        raise DpltmUserError(f"{what} {path.name[:40]}…: a name of {len(name)} bytes is too long to write safely "
                             f"(its temporary file adds {WRITE_NAME_EXTRA}; the file system allows {name_max}): "
                             f"use at most {name_max - WRITE_NAME_EXTRA}")
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        raise DpltmUserError(f"{what} {path} is longer than the file system allows ({path_max} bytes)")
