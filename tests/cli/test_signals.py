"""SIGINT and SIGTERM sent to the real console script at any moment, once or twice 50 ms apart: the run
ends with one line naming the first signal and 128 + its number, no traceback, no temp file; and a run
killed with SIGKILL does not block the next one with its lock or run.json.

The moments: while the CLI is imported (the entry point's early handlers), while the command imports
torch and Lightning and loads its data, and inside Lightning's fit, where its signal connector puts in
its own SIGTERM handler and restores dpltm's when it tears down (where the second signal lands). The
interpreter's own start-up, before `dpltm.entry` runs, is the default handlers' and is not tried.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.datafiles import write_digits

pytestmark = pytest.mark.slow  # fresh processes, each importing torch and Lightning

DPLTM = Path(sys.executable).with_name("dpltm")  # the console script, as users start it
TRAIN = ["train", "--dense", "--dataset", "digits", "--sigma", "1", "--accountant", "rdp", "--batch-size", "32",
         "--device", "cpu", "--out", "m.pt"]
INT, TERM = signal.SIGINT, signal.SIGTERM
PLANS = {"SIGINT": [INT], "SIGTERM twice": [TERM, TERM], "SIGINT twice": [INT, INT], "SIGTERM, SIGINT": [TERM, INT]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_digits(tmp_path_factory.mktemp("data"))


@pytest.fixture
def start(data: Path) -> Iterator[Callable[[list[str], Path], Run]]:
    """Start runs; any still going when the test ends (it failed) is killed."""
    started: list[Run] = []

    def run(args: list[str], folder: Path) -> Run:
        started.append(Run(args, folder, data))
        return started[-1]

    yield run
    for run in started:
        run.process.kill()
        run.process.wait()


class Run:
    """`dpltm ARGS` in a fresh process in `folder`, its stderr read as it comes."""

    def __init__(self, args: list[str], folder: Path, data: Path) -> None:
        folder.mkdir(exist_ok=True)
        env = {**os.environ, "DPLTM_DATA_DIR": str(data), "DPLTM_LOG_DIR": str(folder / "logs")}
        self.folder = folder
        self.process = subprocess.Popen([str(DPLTM), *args], cwd=folder, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for chunk in iter(lambda: self.process.stderr.read1(4096), b""):  # type: ignore[union-attr]
            self.chunks.append(chunk)

    @property
    def stderr(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def handlers_in(self) -> bool:
        """dpltm's own handlers catch SIGTERM (the interpreter's defaults do not)."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return bool(int(re.search(r"SigCgt:\s*(\w+)", status).group(1), 16) & (1 << (TERM - 1)))  # type: ignore[union-attr]

    def wait_until(self, ready: object, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and not (ready() if callable(ready) else str(ready) in self.stderr):
            assert time.monotonic() < deadline, f"never {ready}: {self.stderr[-2000:]}"
            time.sleep(0.005)
        assert self.process.poll() is None, f"ended before {ready}: {self.stderr[-2000:]}"

    def send(self, plan: list[signal.Signals]) -> None:
        for index, signum in enumerate(plan):
            if index:
                time.sleep(0.05)
            self.process.send_signal(signum)

    def wait(self) -> int:
        try:
            code = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"still running 120 s after the signal: {self.stderr[-2000:]}") from None
        self.reader.join(timeout=10)
        return code

    def check_stopped(self, plan: list[signal.Signals]) -> None:
        """Stopped by `plan[0]`, with one line and nothing half-written left."""
        code = self.wait()
        said = self.stderr
        lines = [line for line in re.split(r"[\r\n]", said) if line.startswith("dpltm:")]
        assert (code, "Traceback" in said) == (128 + plan[0], False), said[-3000:]
        assert len(lines) == 1 and lines[0].startswith(f"dpltm: interrupted ({plan[0].name})"), said[-3000:]
        assert not list(self.folder.glob(".*.tmp")) and not list(self.folder.glob(".*.lock"))
        for log in self.folder.glob("logs/*/*/*/run.json"):  # none if stopped before the run began
            assert json.loads(log.read_text())["status"] == "interrupted"


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_a_signal_while_starting(plan: list[signal.Signals], start: Callable[[list[str], Path], Run],
                                 tmp_path: Path) -> None:
    """Signals while the CLI is imported: the entry point's handlers, then the run's."""
    for delay in (0.05, 0.15, 0.3):
        run = start(TRAIN + ["--epochs", "1"], tmp_path / str(delay))
        run.wait_until(run.handlers_in, timeout=30)
        time.sleep(delay)
        run.send(plan)
        run.check_stopped(plan)


LOADING = [("started", 0.8), ("started", 1.4), ("started", 2.0), ("started", 2.6)]
"""While the command imports torch and Lightning and loads its data: seconds after the handlers are in."""
TRAINING = [("DP training epoch 1/", delay) for delay in (0.0, 0.15, 0.3, 0.6)]
"""Inside Lightning's fit: seconds after its first epoch began."""


@pytest.mark.parametrize("moments", [LOADING, TRAINING], ids=["loading", "training"])
def test_signals_while_loading_and_training(moments: list[tuple[str, float]],
                                            start: Callable[[list[str], Path], Run], tmp_path: Path) -> None:
    """Each plan once, four runs at a time; a second signal inside fit lands in Lightning's tear-down."""
    runs = {name: start(TRAIN + ["--epochs", "5000"], tmp_path / str(index)) for index, name in enumerate(PLANS)}
    for (name, run), (marker, delay) in zip(runs.items(), moments):
        run.wait_until(run.handlers_in if marker == "started" else marker)
        time.sleep(delay)
        run.send(PLANS[name])
    for name, run in runs.items():
        run.check_stopped(PLANS[name])


def test_a_killed_run_blocks_no_rerun(start: Callable[[list[str], Path], Run], tmp_path: Path) -> None:
    """SIGKILL mid-training leaves the output's lock file and a run.json still `running`: the rerun takes
    the lock over (the dead holder's flock went with it), writes its model and logs in a new run folder."""
    killed = start(TRAIN + ["--epochs", "5000"], tmp_path)
    killed.wait_until("DP training epoch 1/")
    killed.process.kill()
    killed.wait()
    assert (tmp_path / ".m.pt.lock").exists() and not (tmp_path / "m.pt").exists()
    rerun = start(TRAIN + ["--epochs", "1"], tmp_path)
    assert rerun.wait() == 0, rerun.stderr[-3000:]
    assert (tmp_path / "m.pt").exists() and not list(tmp_path.glob(".*.lock")) and not list(tmp_path.glob(".*.tmp"))
    runs = tmp_path / "logs" / "train" / "digits"
    status = {folder.name: json.loads((folder / "run.json").read_text())["status"] for folder in runs.iterdir()}
    assert status == {"version_0": "running", "version_1": "finished"}
