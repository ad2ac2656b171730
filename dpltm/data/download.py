"""Fetch MNIST, Fashion-MNIST and KMNIST into the data root with torchvision's own classes.

Why torchvision: `torchvision.datasets.MNIST`, `FashionMNIST` and `KMNIST` own the mirrors,
the file names and the official md5s (`resources`), so we copy none of them and follow
upstream when a mirror moves. We only call their `download()`; the dataset is never built
(that would decode every image into tensors), and `mirrors`/`resources` are set on the one
object we create, so torchvision's classes are never mutated.

What is checked: torchvision checks each downloaded `.gz` against its official md5 before
extracting it; our own loader checks the md5 again on read (`dpltm.data.mnist`). Files are
downloaded into a private folder inside `<root>/<Folder>/raw/` and moved into place with
`os.replace` only once torchvision has accepted them, so a failed, corrupt or interrupted
download never leaves a file where the loader would read it (torchvision itself leaves a
corrupt download under its final name). Any failure is one line, and the folders made for
the download are removed again: the disk is left as it was found.

Not covered: HAR, ISOLET and DIGITS (no torchvision class; see the README's Data section),
and stalled connections: torchvision's `urlopen` has no timeout, so a mirror that accepts a
connection and then says nothing blocks until the user interrupts (the private folder is
removed on the way out). A refused connection fails at once.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from dpltm.data.loaders import DATASETS
from dpltm.data.mnist import FOLDERS
from dpltm.errors import DpltmUserError
from dpltm.paths import DATA_DIR_ENV, resolve_data_dir

if TYPE_CHECKING:
    from torchvision.datasets import MNIST

DOWNLOADABLE: tuple[str, ...] = ("mnist", "fashion-mnist", "kmnist")
MIRROR_ENV = "DPLTM_DOWNLOAD_MIRROR"
_MIRROR_SCHEMES = ("http", "https")  # torchvision's `_urlretrieve` cannot read file:// responses
_IDX_UINT8 = b"\x00\x00\x08"  # IDX magic of a uint8 file, before the number of dimensions


@dataclass(frozen=True)
class DownloadResult:
    """What `download_dataset` did: official `.gz` names fetched now and those already present."""

    dataset: str
    root: Path
    fetched: tuple[str, ...]
    present: tuple[str, ...]

    def summary(self) -> str:
        """One line for the CLI to print."""
        where = self.root / FOLDERS[self.dataset] / "raw"
        return f"{self.dataset}: fetched {len(self.fetched)}, already present {len(self.present)} in {where}"


def download_root(data_dir: str | os.PathLike[str] | None, made: list[Path] | None = None) -> Path:
    """The data root to download into, created when named explicitly.

    Same order as `resolve_data_dir` (argument, then $DPLTM_DATA_DIR, then ../shared/data),
    but a root the user named may not exist yet: downloading is how it gets filled. The folders
    it creates are appended to `made`, innermost first, for a failed download to remove.
    """
    named = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if named is not None:
        root = Path(named).expanduser()
        if made is not None:
            made += _absent(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise DpltmUserError(f"data directory {root} exists but is not a directory") from None
        except OSError as exc:
            raise DpltmUserError(f"cannot create data directory {root}: {exc.strerror or exc}") from None
    return resolve_data_dir(data_dir)


def download_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, *, mirror: str | None = None
) -> DownloadResult:
    """Fetch the official files of `name` that are not already present into `<root>/<Folder>/raw/`.

    `mirror` (else $DPLTM_DOWNLOAD_MIRROR) replaces torchvision's mirrors with one URL base,
    e.g. an organisation's internal copy. torchvision keeps the `.gz` and also writes an
    uncompressed copy beside it; we keep both: the loader reads the `.gz` (so fingerprints
    are unchanged), and the uncompressed copies let `torchvision.datasets.MNIST(root)` and
    friends use the same root directly (their `_check_exists` looks only for those).
    """
    _check_downloadable(name)
    mirrors = _chosen_mirror(mirror)
    dataset_class = _torchvision_class(name)
    made: list[Path] = []
    root = download_root(data_dir, made)
    raw_dir = root / FOLDERS[name] / "raw"
    made[:0] = _absent(raw_dir)
    fetched: list[str] = []
    present: list[str] = []
    try:
        for filename, md5 in dataset_class.resources:
            if _already_present(raw_dir, filename, md5):
                present.append(filename)
                continue
            _fetch(dataset_class, raw_dir, (filename, md5), mirrors or list(dataset_class.mirrors))
            fetched.append(filename)
    except BaseException:  # an interrupt too: no empty MNIST/raw (or data root) is left behind
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: files fetched before the failure are kept
        raise
    return DownloadResult(name, root, tuple(fetched), tuple(present))


def _check_downloadable(name: str) -> None:
    """Refuse names torchvision cannot fetch, saying where those datasets come from."""
    if name not in DATASETS:
        raise DpltmUserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if name not in DOWNLOADABLE:
        raise DpltmUserError(
            f"{name} cannot be downloaded: only {', '.join(DOWNLOADABLE)} can (torchvision's datasets); "
            f"HAR and ISOLET come from the UCI archive and DIGITS is scikit-learn's digits.csv.gz: "
            f"place them by hand as the README's Data section shows"
        )


def _chosen_mirror(mirror: str | None) -> list[str]:
    """The mirror to use as a one-element list, or [] for torchvision's own mirrors."""
    if mirror is not None:
        chosen, source = mirror, "the mirror option"
    elif os.environ.get(MIRROR_ENV):
        chosen, source = os.environ[MIRROR_ENV], f"${MIRROR_ENV}"
    else:
        return []
    try:
        parsed = urlparse(chosen)
        parsed.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        parsed = urlparse("")
    if re.search(r"[^!-~]", chosen):  # urllib would fail on it (http.client.InvalidURL, UnicodeEncodeError)
        raise DpltmUserError(
            f"download mirror {chosen!r} (from {source}) contains a space, a control character or a "
            f"non-ASCII character: percent-encode it, e.g. https://mirror.example.org/my%20mnist/"
        )
    if parsed.scheme not in _MIRROR_SCHEMES or not parsed.netloc:
        raise DpltmUserError(
            f"download mirror {chosen!r} (from {source}) must be an http:// or https:// URL, "
            f"e.g. https://mirror.example.org/mnist/"
        )
    return [chosen if chosen.endswith("/") else chosen + "/"]


def _torchvision_class(name: str) -> type[MNIST]:
    """torchvision's class for `name`; its name is also the folder under the root (`FOLDERS`).

    Imported here, not at module level: torchvision is slow to import and only --download needs it
    (it is the `download` extra, so that installing dpltm never replaces the user's torch with the
    one a torchvision release pins).
    """
    try:
        from torchvision import datasets
    except ImportError as exc:
        raise DpltmUserError(f"--download fetches through torchvision, which is not importable ({exc}): "
                             "pip install 'dpltm[download]', or the torchvision release that matches your torch"
                             ) from None

    return getattr(datasets, FOLDERS[name])


def _absent(folder: Path) -> list[Path]:
    """`folder` and its parents that do not exist yet, innermost first."""
    return [path for path in (folder, *folder.parents) if not path.exists()]


def _already_present(raw_dir: Path, filename: str, md5: str) -> bool:
    """Whether the loader would already read a good copy of `filename`.

    The loader prefers the `.gz`, so a `.gz` counts only with the official md5 (otherwise it
    is replaced); without a `.gz`, a complete uncompressed file counts.
    """
    from torchvision.datasets.utils import check_integrity

    gz = raw_dir / filename
    if gz.exists():
        return check_integrity(str(gz), md5)
    return _idx_complete(raw_dir / _uncompressed_name(filename))


def _uncompressed_name(filename: str) -> str:
    """The name torchvision extracts `filename` to."""
    return filename.removesuffix(".gz")


def _idx_complete(path: Path) -> bool:
    """Whether a uint8 IDX file holds as many bytes as its header declares.

    Reads the header only. torchvision's own check is mere existence, which would accept a
    copy cut short and never fetch it again.
    """
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
            if len(magic) != 4 or magic[:3] != _IDX_UINT8 or magic[3] == 0:
                return False
            dims = handle.read(4 * magic[3])
        size = path.stat().st_size
    except OSError:
        return False
    if len(dims) != 4 * magic[3]:
        return False
    return size == 4 + len(dims) + math.prod(struct.unpack(f">{magic[3]}I", dims))


def _fetch(dataset_class: type[MNIST], raw_dir: Path, resource: tuple[str, str], mirrors: list[str]) -> None:
    """Download and extract one file with torchvision's `download()`, then move both into `raw_dir`.

    torchvision works in a private folder inside `raw_dir` (same file system, so `os.replace`
    is atomic), which is removed whatever happens: nothing half-written is ever published.
    Its progress bar is silenced: drawn before a failure, it would bury the one-line error,
    and the summary says what was fetched.
    """
    filename, md5 = resource
    try:
        raw_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=raw_dir, prefix=".download-") as staging:
            dataset = dataset_class.__new__(dataset_class)  # no __init__: it would decode every image
            dataset.root = staging
            dataset.mirrors = mirrors
            dataset.resources = [resource]
            with contextlib.redirect_stderr(io.StringIO()):
                dataset.download()
            staged = Path(dataset.raw_folder)
            for produced in (filename, _uncompressed_name(filename)):
                os.replace(staged / produced, raw_dir / produced)
    except Exception as exc:  # urllib's and http.client's errors, torchvision's, a full disk: all the same to the user
        raise DpltmUserError(
            f"cannot download {filename} (official md5 {md5}) from {' or '.join(mirrors)}: {_one_line(exc)}; "
            f"put the official files into {raw_dir} by hand (README, Data section)"
        ) from None


def _one_line(exc: BaseException) -> str:
    """torchvision's multi-line error as one line, without the headers that repeat file and mirror;
    other errors (http.client's, e.g. BadStatusLine) say little without their name."""
    lines = (line.strip().rstrip(".:") for line in str(exc).splitlines())
    reason = "; ".join(line for line in lines if line and not line.startswith(("Error downloading", "Tried ")))
    if isinstance(exc, (RuntimeError, OSError)) and reason:
        return reason
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


def fetch_for_run(names: list[str], data_dir: str | os.PathLike[str] | None) -> list[DownloadResult]:
    """`--download` on a command: fetch what torchvision can fetch among the datasets it uses;
    the others (HAR, ISOLET, DIGITS) must already be in the data root, and their loaders say
    which file is missing if not."""
    return [download_dataset(name, data_dir) for name in dict.fromkeys(names) if name in DOWNLOADABLE]
