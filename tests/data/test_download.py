"""`download_dataset` against a local HTTP mirror serving the real MNIST files (never the internet)."""

from __future__ import annotations

import functools
import gzip
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dpltm import paths
from dpltm.data import load_dataset
from dpltm.data.download import MIRROR_ENV, download_dataset, download_root
from dpltm.data.mnist import FOLDERS, OFFICIAL
from dpltm.errors import DpltmUserError

SHARED_MNIST = Path(__file__).resolve().parents[3] / "shared" / "data" / "MNIST" / "raw"
MNIST_FILES = tuple(OFFICIAL["MNIST"])
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


def _shared_mnist() -> Path:
    """The real MNIST .gz files, or a skip saying why the download tests cannot run."""
    if not all((SHARED_MNIST / name).is_file() for name in MNIST_FILES):
        pytest.skip(f"the official MNIST .gz files are not in {SHARED_MNIST}")
    return SHARED_MNIST


class _QuietHandler(SimpleHTTPRequestHandler):
    """Serves a folder, records each requested path, logs nothing."""

    requests: list[str]

    def do_GET(self) -> None:
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    """torchvision's redirect probe drops the connection before reading the body: not an error here."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@dataclass
class Mirror:
    url: str
    folder: Path
    requests: list[str]


@pytest.fixture(autouse=True)
def _no_proxy_no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy may intercept 127.0.0.1, and the user's own settings must not leak in."""
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Mirror]:
    """A local HTTP server in a daemon thread, serving copies of the real MNIST .gz files."""
    source = _shared_mnist()
    folder = tmp_path / "served"
    folder.mkdir()
    for name in MNIST_FILES:
        shutil.copyfile(source / name, folder / name)
    requests: list[str] = []
    handler = type("Handler", (_QuietHandler,), {"requests": requests})
    server = _QuietServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield Mirror(f"http://127.0.0.1:{server.server_address[1]}/", folder, requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _closed_port() -> int:
    """A local port nobody listens on: connecting to it is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _raw(root: Path) -> Path:
    return root / "MNIST" / "raw"


def test_download_matches_shared_data_and_second_call_fetches_nothing(mirror: Mirror, tmp_path: Path) -> None:
    root = tmp_path / "fresh" / "data"  # does not exist yet: created because it is named
    result = download_dataset("mnist", root, mirror=mirror.url)
    assert result.root == root and result.dataset == "mnist"
    assert sorted(result.fetched) == sorted(MNIST_FILES) and result.present == ()
    assert sorted(p.name for p in _raw(root).iterdir()) == sorted(
        MNIST_FILES + tuple(name.removesuffix(".gz") for name in MNIST_FILES)
    )  # the .gz and torchvision's uncompressed copies; no staging folder left behind
    ours = load_dataset("mnist", data_dir=root, split="train")
    shared = load_dataset("mnist", data_dir=SHARED_MNIST.parents[1], split="train")
    assert ours.fingerprint == shared.fingerprint  # same md5s, same layout

    mirror.requests.clear()
    again = download_dataset("mnist", root, mirror=mirror.url)
    assert again.fetched == () and sorted(again.present) == sorted(MNIST_FILES)
    assert mirror.requests == []
    assert "fetched 0, already present 4" in again.summary()


def test_corrupt_file_on_mirror_is_one_line_and_never_published(mirror: Mirror, tmp_path: Path) -> None:
    bad = "train-labels-idx1-ubyte.gz"
    served = mirror.folder / bad
    original = served.read_bytes()
    served.write_bytes(original[:-10] + bytes(10))  # same size, wrong md5
    with pytest.raises(DpltmUserError) as caught:
        download_dataset("mnist", tmp_path, mirror=mirror.url)
    message = str(caught.value)
    assert "\n" not in message and bad in message and mirror.url in message
    assert "by hand" in message
    # the file before it was fetched and kept; nothing of the bad one, no staging folder
    assert sorted(p.name for p in _raw(tmp_path).iterdir()) == ["train-images-idx3-ubyte", "train-images-idx3-ubyte.gz"]

    served.write_bytes(original)  # the mirror is mended: a re-run fetches only what is missing
    result = download_dataset("mnist", tmp_path, mirror=mirror.url)
    assert result.present == ("train-images-idx3-ubyte.gz",)
    assert sorted(result.fetched) == sorted(set(MNIST_FILES) - {"train-images-idx3-ubyte.gz"})


def test_mirror_from_env_and_partial_root(mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Good files already there are kept; a .gz with the wrong md5 is replaced."""
    raw = _raw(tmp_path)
    raw.mkdir(parents=True)
    shutil.copyfile(SHARED_MNIST / "train-images-idx3-ubyte.gz", raw / "train-images-idx3-ubyte.gz")
    labels = gzip.decompress((SHARED_MNIST / "train-labels-idx1-ubyte.gz").read_bytes())
    (raw / "train-labels-idx1-ubyte").write_bytes(labels)  # uncompressed only: good enough
    (raw / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not the official file")
    monkeypatch.setenv(MIRROR_ENV, mirror.url.rstrip("/"))  # the trailing slash is optional
    from torchvision.datasets import MNIST

    before = (list(MNIST.mirrors), list(MNIST.resources))
    result = download_dataset("mnist", tmp_path)
    assert (MNIST.mirrors, MNIST.resources) == before  # torchvision's class is never mutated
    assert result.present == ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    assert result.fetched == ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    assert sorted(mirror.requests, key=len)[-1].endswith("t10k-labels-idx1-ubyte.gz")
    assert (raw / "t10k-labels-idx1-ubyte.gz").read_bytes() == (SHARED_MNIST / "t10k-labels-idx1-ubyte.gz").read_bytes()


def test_truncated_uncompressed_file_is_not_present(mirror: Mirror, tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    raw.mkdir(parents=True)
    labels = gzip.decompress((SHARED_MNIST / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (raw / "t10k-labels-idx1-ubyte").write_bytes(labels[:-1])
    for name in MNIST_FILES[:3]:
        shutil.copyfile(SHARED_MNIST / name, raw / name)
    result = download_dataset("mnist", tmp_path, mirror=mirror.url)
    assert result.fetched == ("t10k-labels-idx1-ubyte.gz",)
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes() == labels


@pytest.mark.parametrize("name", ["har", "isolet", "digits"])
def test_non_torchvision_datasets_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(DpltmUserError) as caught:
        download_dataset(name, tmp_path / "never")
    message = str(caught.value)
    assert "\n" not in message and "mnist, fashion-mnist, kmnist" in message
    assert "UCI" in message and "digits.csv.gz" in message and "README" in message
    assert not (tmp_path / "never").exists()  # refused before touching the disk


def test_unknown_dataset_lists_choices(tmp_path: Path) -> None:
    with pytest.raises(DpltmUserError) as caught:
        download_dataset("cifar", tmp_path)
    assert "\n" not in str(caught.value) and "mnist, fashion-mnist, kmnist, har, isolet, digits" in str(caught.value)


@pytest.mark.parametrize("url", ["ftp://host/mnist/", "file:///srv/mnist/", "mirror.example.org/mnist/", ""])
def test_bad_mirror_is_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(DpltmUserError, match="http:// or https://"):
        download_dataset("mnist", tmp_path, mirror=url)


def test_download_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert download_root(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path / "from-env"))
    assert download_root(None) == tmp_path / "from-env" and (tmp_path / "from-env").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(DpltmUserError, match="not a directory"):
        download_root(tmp_path / "file")
    monkeypatch.delenv(paths.DATA_DIR_ENV)
    monkeypatch.setattr(paths, "default_data_dirs", lambda: [tmp_path / "no-default"])
    with pytest.raises(DpltmUserError, match="--data-dir") as caught:
        download_root(None)
    assert "\n" not in str(caught.value)


def test_folders_and_md5s_agree_with_torchvision() -> None:
    """The folder is torchvision's class name, and our loader's md5s are torchvision's."""
    from torchvision import datasets

    for folder in FOLDERS.values():
        resources = dict(getattr(datasets, folder).resources)
        assert resources == {name: md5 for name, (md5, _) in OFFICIAL[folder].items()}


def test_train_with_download_fetches_then_dpltm_download_finds_all_present(mirror: Mirror, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch, cli) -> None:
    """The user's path: `--download` on a command into an empty root, md5-checked, served locally;
    then `dpltm download` finds everything; a dataset torchvision cannot fetch is left to its loader."""
    import json


    root = tmp_path / "data"
    monkeypatch.setenv(MIRROR_ENV, mirror.url)
    trained = cli("train", "--dense", "--dataset", "mnist", "--download", "--data-dir", str(root),
                  "--eps", "1", "--epochs", "1", "--batch-size", "4000", "--device", "cpu",
                  "--no-progress", "--out", str(tmp_path / "m.pt"), "--json")
    assert {path.rsplit("/", 1)[-1] for path in mirror.requests} == set(MNIST_FILES)  # all four, fetched now
    assert json.loads(trained.stdout)["dataset"] == "mnist"
    mirror.requests.clear()
    again = cli("download", "mnist", "--data-dir", str(root))
    assert "mnist: fetched 0, already present 4" in again.stderr and mirror.requests == []
    har = cli("train", "--dense", "--dataset", "har", "--download", "--data-dir", str(root),
              "--device", "cpu", "--out", str(tmp_path / "h.pt"), ok=False)
    assert har.exit_code == 2 and "missing file" in har.stderr and "X_train.txt" in har.stderr
    explicit = cli("download", "har", "--data-dir", str(root), ok=False)
    assert explicit.exit_code == 2 and "har cannot be downloaded" in explicit.stderr


def test_download_without_torchvision_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision is the `download` extra: without it, --download says how to get it."""
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(DpltmUserError, match=r"pip install 'dpltm\[download\]'") as caught:
        download_dataset("mnist", tmp_path)
    assert "\n" not in str(caught.value)


class _BadMirrorHandler(BaseHTTPRequestHandler):
    """Answers every GET the way `mode` says: 404, a redirect to itself, a body that is not the
    file, a body cut short of its Content-Length, or bytes that are not HTTP at all."""

    mode: str

    def do_GET(self) -> None:
        self.close_connection = True
        if self.mode == "not-http":
            self.wfile.write(b"garbage\r\n\r\n")
        elif self.mode == "404":
            self.send_error(404)
        elif self.mode == "redirect":
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20 if self.mode == "short-read" else 4096))
            self.end_headers()
            self.wfile.write(bytes(range(256)) * 16)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _tree(root: Path) -> list[Path]:
    return sorted(path.relative_to(root) for path in root.rglob("*"))


@pytest.mark.parametrize("mode", ["refused", "404", "redirect", "garbage", "short-read", "not-http"])
def test_failed_download_is_one_line_silent_and_leaves_nothing(mode: str, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """Whatever goes wrong, the user sees one line, no progress bar, and the disk as it was:
    the dataset folder that existed before is kept, an empty raw/ or data root is not left behind."""
    (tmp_path / "data" / "MNIST").mkdir(parents=True)
    root = tmp_path / ("new" if mode == "refused" else "data")  # the named root is created, then removed
    before = _tree(tmp_path)
    server = _QuietServer(("127.0.0.1", 0), type("Handler", (_BadMirrorHandler,), {"mode": mode}))
    url = f"http://127.0.0.1:{server.server_address[1] if mode != 'refused' else _closed_port()}/"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with pytest.raises(DpltmUserError) as caught:
            download_dataset("mnist", root, mirror=url)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    message = str(caught.value)
    assert "\n" not in message and url in message and "train-images-idx3-ubyte.gz" in message
    assert _tree(tmp_path) == before
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("url", ["http://host/a b\nc/", "http://host/a b/", "http://host/mnist\t/"])
def test_mirror_with_space_or_control_character_is_refused(url: str, tmp_path: Path, cli) -> None:
    result = cli("download", "mnist", "--mirror", url, "--data-dir", str(tmp_path / "new"), ok=False)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "percent-encode" in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before touching the disk


def test_url_urllib_cannot_request_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL that http.client refuses to send (here in torchvision's own mirror list) is one line too."""
    from torchvision.datasets import MNIST

    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/a b/"])
    with pytest.raises(DpltmUserError, match="InvalidURL: URL can't contain control characters") as caught:
        download_dataset("mnist", tmp_path)
    assert "\n" not in str(caught.value) and list(tmp_path.iterdir()) == []
