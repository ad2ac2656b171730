"""The real CLI as users run it: a subprocess of `python -m dpltm.cli`, progress bars left ON.

Every other CLI test passes `--no-progress` through typer's runner, which is how a progress bar
on stdout once slipped past them and broke `--json`. Here stdout must be exactly one JSON
document with the default progress bars, and the whole pipeline (generate → select → train →
inspect) runs on the CPU and, in the `gpu` variant, on CUDA — the path that once crashed on
the first GPU it met (Lightning's teardown moved the model back to the CPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.datafiles import write_digits

pytestmark = pytest.mark.slow  # end to end, in fresh processes


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dpltm(*args: str, cwd: Path, data: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    # as a user runs it: run folders under ./logs (the default), not the suite's $DPLTM_LOG_DIR
    env = {**{k: v for k, v in os.environ.items() if k != "DPLTM_LOG_DIR"}, "DPLTM_DATA_DIR": str(data),
           "COLUMNS": "100"}
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", *args], cwd=cwd, env=env, text=True,
                            capture_output=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_json_document(stdout: str) -> dict:  # type: ignore[type-arg]
    return json.loads(stdout)  # raises on anything before or after the document


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_digits(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("device", DEVICES)
def test_pipeline_with_progress_bars_prints_one_json_document(device: str, data: Path, tmp_path: Path) -> None:
    generated = dpltm("generate", "--dataset", "digits", "--rounds", "2", "--iterations", "60", "--batch-size", "32",
                      "--device", device, "--out", "t.pt", "--json", cwd=tmp_path, data=data)
    tickets = one_json_document(generated.stdout)
    assert [t["round"] for t in tickets["tickets"]] == [0, 1, 2]
    assert "round 2/2" in generated.stderr  # the progress bar ran, on stderr
    chosen = one_json_document(dpltm("select", "--tickets", "t.pt", "--eps1", "1", "--out", "w.pt", "--json",
                                     cwd=tmp_path, data=data).stdout)
    assert chosen["selection"]["method"] == "exponential" and "NOT end-to-end" in chosen["same_data_note"]
    trained = dpltm("train", "--ticket", "w.pt", "--dataset", "digits", "--eps2", "1", "--epochs", "2",
                    "--batch-size", "32", "--device", device, "--out", "m.pt", "--json", cwd=tmp_path, data=data)
    report = one_json_document(trained.stdout)
    assert "DP training" in trained.stderr  # progress bar on stderr
    assert report["end_to_end_dp"] is False and report["epsilon"] == "inf"  # same-data tickets
    assert 0 < report["epsilon_dp_part"] <= 1.0 + 1.0 + 1e-9
    assert 0.0 <= report["test_accuracy"] <= 1.0
    shown = one_json_document(dpltm("inspect", "t.pt", "--json", cwd=tmp_path, data=data).stdout)
    assert shown["tickets"] == tickets["tickets"]
    dense = one_json_document(dpltm("train", "--dense", "--dataset", "digits", "--eps2", "1", "--epochs", "2",
                                    "--batch-size", "32", "--device", device, "--json", cwd=tmp_path,
                                    data=data).stdout)
    assert dense["end_to_end_dp"] is True and dense["epsilon"] <= 1.0
    # each run got its own versioned folder under ./logs; the same-data run never logs a bare "epsilon"
    assert report["log_dir"] == str(Path("logs") / "train" / "digits" / "version_0")
    assert dense["log_dir"] == str(Path("logs") / "train" / "digits" / "version_1")
    assert sorted(p.name for p in (tmp_path / "logs" / "generate" / "digits").iterdir()) == ["version_0"]
    header, *rows = (tmp_path / report["log_dir"] / "metrics.csv").read_text().splitlines()
    assert "epsilon_dp_part" in header.split(",") and "epsilon" not in header.split(",") and len(rows) == 2
    run = json.loads((tmp_path / report["log_dir"] / "run.json").read_text())
    assert run["status"] == "finished" and run["report"]["end_to_end_dp"] is False and len(run["history"]) == 2
    dense_header = (tmp_path / dense["log_dir"] / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "epsilon" in dense_header


def test_no_arguments_prints_help_and_no_empty_error(tmp_path: Path, data: Path) -> None:
    result = dpltm(cwd=tmp_path, data=data, check=False)
    assert "Usage" in result.stdout + result.stderr
    assert "error" not in result.stderr


@pytest.mark.parametrize(("signum", "code", "twice"), [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, False),
                                                      (signal.SIGTERM, 143, True), (signal.SIGINT, 130, True)])
@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_signal_stops_a_run_with_one_line_and_no_partial_output(command: str, signum: int, code: int, twice: bool,
                                                                  data: Path, tmp_path: Path) -> None:
    """One signal, or a second one during the clean-up (Lightning's signal connector once put dpltm's
    handler back over its SIG_IGN, so the second gave exit -15 or a traceback and run.json stayed
    'running')."""
    args = {"generate": ["generate", "--dataset", "digits", "--rounds", "3", "--iterations", "100000",
                         "--batch-size", "32", "--out", "t.pt"],
            "train": ["train", "--dense", "--dataset", "digits", "--eps2", "1", "--epochs", "5000",
                      "--batch-size", "32", "--out", "m.pt"]}[command]
    env = {**os.environ, "DPLTM_DATA_DIR": str(data), "DPLTM_LOG_DIR": str(tmp_path / "logs")}
    process = subprocess.Popen([sys.executable, "-m", "dpltm.cli", *args, "--device", "cpu"], cwd=tmp_path, env=env,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    marker = "round 0" if command == "generate" else "DP training"
    seen = ""
    assert process.stderr is not None
    while marker not in seen and time.monotonic() < deadline:  # wait until training is under way
        seen += process.stderr.read(1) or ""
        if process.poll() is not None:
            break
    process.send_signal(signum)
    if twice:
        time.sleep(0.05)
        if process.poll() is None:
            process.send_signal(signum)
    _, rest = process.communicate(timeout=120)
    lines = [line for line in re.split(r"[\r\n]", seen + rest) if line.startswith("dpltm:")]
    assert process.returncode == code, seen + rest
    assert lines == [lines[0]] and lines[0].startswith(f"dpltm: interrupted ({signal.Signals(signum).name})")
    assert "Traceback" not in seen + rest
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not [name for name in left if name.endswith((".tmp", ".lock"))]
    (folder,) = (tmp_path / "logs" / command / "digits").iterdir()  # the run's log says how it ended
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"
    if command == "generate":  # what it says was kept is what is there
        assert ("finished rounds are kept in t.pt" if "t.pt" in left else "nothing was written to t.pt") in lines[0]
    if command == "train":
        assert "m.pt" not in left and "no model was written" in lines[0]


@pytest.mark.gpu
def test_pipeline_with_cuda_graphs(data: Path, tmp_path: Path) -> None:
    """generate and train with every step replayed from CUDA graphs, through the real CLI."""
    dpltm("generate", "--dataset", "digits", "--rounds", "1", "--iterations", "60", "--batch-size", "32",
          "--device", "cuda", "--cuda-graphs", "--out", "t.pt", cwd=tmp_path, data=data)
    dpltm("select", "--tickets", "t.pt", "--eps1", "1", "--out", "w.pt", cwd=tmp_path, data=data)
    report = one_json_document(dpltm("train", "--ticket", "w.pt", "--dataset", "digits", "--eps2", "1", "--epochs", "2",
                                     "--batch-size", "32", "--device", "cuda", "--cuda-graphs", "--out", "m.pt",
                                     "--json", cwd=tmp_path, data=data).stdout)
    assert report["steps"] > 0 and report["test_accuracy"] > 0.5


@pytest.mark.gpu
def test_scatter_head_pipeline_with_cuda_graphs(data: Path, tmp_path: Path) -> None:
    """A ScatterNet linear head (the README job's network) generated and DP-trained from CUDA graphs, through
    the real CLI: its fully connected head takes the fused DP step, which the graphs replay."""
    dpltm("generate", "--dataset", "digits", "--arch", "scatter-linear", "--rounds", "2", "--iterations", "60",
          "--batch-size", "32", "--device", "cuda", "--cuda-graphs", "--out", "t.pt", cwd=tmp_path, data=data)
    dpltm("select", "--tickets", "t.pt", "--eps1", "1", "--out", "w.pt", cwd=tmp_path, data=data)
    report = one_json_document(dpltm("train", "--ticket", "w.pt", "--dataset", "digits", "--eps2", "1", "--epochs", "3",
                                     "--batch-size", "32", "--device", "cuda", "--cuda-graphs", "--out", "m.pt",
                                     "--json", cwd=tmp_path, data=data).stdout)
    assert report["steps"] > 0 and report["test_accuracy"] > 0.3 and report["end_to_end_dp"] is False


def test_a_signal_while_starting_is_one_line_not_a_traceback() -> None:
    """The console script's first act (dpltm.entry): before the CLI's half second of imports, a signal
    ends the process with one line and 128 + signum."""
    code = ("from dpltm.entry import install_start_handlers; install_start_handlers(); "
            "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(10)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130
    assert result.stderr.strip().splitlines() == ["dpltm: interrupted (SIGINT) while starting; nothing was written"]


def test_an_interrupted_run_names_what_its_earlier_stages_kept(data: Path, tmp_path: Path) -> None:
    """`dpltm run` stopped in its training stage: the one line names the ticket its first stage finished (it is
    there, whole) and says no model was written."""
    env = {**os.environ, "DPLTM_DATA_DIR": str(data), "DPLTM_LOG_DIR": str(tmp_path / "logs")}
    process = subprocess.Popen([sys.executable, "-m", "dpltm.cli", "run", "--ticket-source", "private", "--dataset",
                                "digits", "--epochs", "400", "--warmup-epochs", "1", "--batch-size", "32", "--device",
                                "cpu", "--out", "m.pt"], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, deadline = "", time.monotonic() + 120
    assert process.stderr is not None
    while "2/2" not in seen and time.monotonic() < deadline and process.poll() is None:
        seen += process.stderr.read(1) or ""
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    lines = [line for line in re.split(r"[\r\n]", seen + rest) if line.startswith("dpltm:")]
    assert process.returncode == 130, seen + rest
    assert lines == ["dpltm: interrupted (SIGINT); the private ticket is kept in m-ticket.pt; no model was written"]
    assert (tmp_path / "m-ticket.pt").exists() and not (tmp_path / "m.pt").exists()


def test_the_lightning_free_bar_draws_lightnings_format() -> None:
    """dpltm.progress keeps a copy of Lightning's bar format (so the noise-aware choice imports no Lightning):
    the copy must be Lightning's."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    from dpltm.progress import BAR_FORMAT

    assert BAR_FORMAT == TQDMProgressBar.BAR_FORMAT
