"""The CLI: a real generate → inspect round trip, and one clean line for every user mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.datafiles import write_digits


@pytest.fixture
def digits_dir(tmp_path: Path) -> Path:
    return write_digits(tmp_path / "data")


def test_generate_then_inspect(digits_dir: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "tickets.pt"
    result = cli("generate", "--dataset", "digits", "--data-dir", str(digits_dir), "--rounds", "2",
                 "--iterations", "20", "--batch-size", "32", "--device", "cpu", "--out", str(out),
                 "--no-progress", "--json")
    report = json.loads(result.stdout)
    assert [t["round"] for t in report["tickets"]] == [0, 1, 2]
    assert report["config"]["generate"]["iterations"] == 20
    assert report["config"]["generate"]["batch_size"] == 32  # CLI beats configs/datasets/digits.yaml
    assert report["privacy"]["phase1"] == "non-private"
    shown = cli("inspect", str(out), "--json", ok=False)
    assert shown.exit_code == 0
    assert json.loads(shown.stdout)["tickets"] == report["tickets"]
    table = cli("inspect", str(out), ok=False)
    assert "WITHOUT privacy" in table.stdout and "val acc" in table.stdout


def test_a_second_generate_says_it_continues_the_file_it_finds(digits_dir: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "tickets.pt"
    flags = ("generate", "--dataset", "digits", "--data-dir", str(digits_dir), "--rounds", "1", "--iterations", "10",
             "--batch-size", "32", "--device", "cpu", "--out", str(out), "--no-progress")

    def said(*extra: str) -> str:  # rich may fold a long path anywhere: compare without white space
        return "".join(cli(*flags, *extra).stderr.split())

    assert "generatingticketsondigits" in said()
    assert f"continuingtheticketsin{out}(itsfinishedroundsarekept)ondigits" in said()
    assert "generatingticketsondigits" in said("--overwrite")


def test_a_batch_above_the_records_is_said_to_be_full_batch(digits_dir: Path, tmp_path: Path, cli) -> None:
    """IMP's batches are capped at the training set (`ShuffledBatches`): a larger --batch-size runs, and says so."""
    flags = ("generate", "--dataset", "digits", "--data-dir", str(digits_dir), "--rounds", "0", "--iterations", "2",
             "--device", "cpu", "--no-progress", "--overwrite", "--out", str(tmp_path / "t.pt"))
    big = " ".join(cli(*flags, "--batch-size", "100000").stderr.split())
    assert "note: --batch-size 100000 is above the" in big and "(full-batch IMP)" in big
    assert "full-batch" not in cli(*flags, "--batch-size", "32").stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--dataset", "digits", "--prune-rates", "0,0.3,0.2"], "(0, 1)"),
        (["generate", "--dataset", "digits", "--prune-rates", "a,b"], "comma-separated"),
        (["generate", "--dataset", "digits", "--iterations", "0"], "--iterations must be positive"),
        (["generate", "--dataset", "digits", "--device", "cuda:99"],
         "CUDA is not available" if not torch.cuda.is_available() else "CUDA device(s)"),
        (["generate", "--dataset", "digits", "--config", "/nonexistent.yaml"], "does not exist"),
        (["inspect", "/nonexistent/tickets.pt"], "does not exist"),
    ],
)
def test_user_mistakes_are_one_line(args: list[str], message: str, digits_dir: Path,
                                    tmp_path: Path, cli) -> None:
    result = cli(*args, "--data-dir", str(digits_dir), ok=False) if args[0] == "generate" else cli(*args, ok=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpltm: error:"), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output


def test_missing_data_file_names_it(tmp_path: Path, cli) -> None:
    result = cli("generate", "--dataset", "kmnist", "--data-dir", str(tmp_path), "--out",
                 str(tmp_path / "t.pt"), ok=False)
    assert result.exit_code == 2
    assert "train-images-idx3-ubyte.gz" in result.stderr and "md5" in result.stderr
    assert not (tmp_path / "t.pt").exists()


def test_foreign_checkpoint_and_bad_yaml(tmp_path: Path, cli) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_text("hello")
    result = cli("inspect", str(junk), ok=False)
    assert result.exit_code == 2 and "not a readable dpltm checkpoint" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("generate: {rounds: [}")
    result = cli("generate", "--config", str(bad), ok=False)
    assert result.exit_code == 2 and "not valid YAML" in result.stderr
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("generate: {roundz: 3}")
    result = cli("generate", "--config", str(unknown), ok=False)
    assert result.exit_code == 2 and "roundz" in result.stderr


def test_output_that_is_a_directory(digits_dir: Path, tmp_path: Path, cli) -> None:
    result = cli("generate", "--dataset", "digits", "--data-dir", str(digits_dir), "--out",
                 str(tmp_path), ok=False)
    assert result.exit_code == 2 and "is a directory" in result.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["dpltm", "train", "--epochs", "abc"], "Invalid value for '--epochs'"),
    (["dpltm", "generate", "--no-such-option"], "No such option"),
    (["dpltm", "inspect", "/nonexistent.pt"], "does not exist"),
])
def test_entry_point_errors_are_one_line(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from dpltm.cli import main

    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpltm: error:") and message in err[0]


@pytest.mark.parametrize("name", ["cuda:1", "cuda:999"])
def test_an_absent_gpu_ordinal_is_one_line(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a one-GPU machine (torch.device keeps ordinals in 8 bits: cuda:999 reads as cuda:-25)."""
    from dpltm.devices import resolve_device
    from dpltm.errors import DpltmUserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DpltmUserError, match="has 1 CUDA device"):
        resolve_device(name)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
