"""Outputs people use: export to safetensors, predict (in a fresh process, as a user would),
inspect on an export, versions in every checkpoint, and versioned run folders written through
Lightning's loggers (CSV and TensorBoard) that never understate ε."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dpltm.checkpoint import load_checkpoint, load_trained_model
from dpltm.errors import DpltmUserError
from dpltm.run_log import RunLog, claim_version_folder, float32_at_least
from tests.datafiles import write_digits, write_mnist

FAST = ["--device", "cpu", "--no-progress"]


@pytest.fixture(scope="session")
def invoke(cli):  # type: ignore[no-untyped-def]
    def run(*args: str) -> dict:  # type: ignore[type-arg]
        result = cli(*args, "--json")
        return json.loads(result.stdout)

    return run


@pytest.fixture(scope="session")
def fails(cli):  # type: ignore[no-untyped-def]
    def run(*args: str) -> str:
        result = cli(*args, ok=False)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    return run


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_digits(root)
    write_mnist(root, "MNIST", n_train=80, n_test=20)
    return root


@pytest.fixture(scope="module")
def trained(data_root: Path, tmp_path_factory: pytest.TempPathFactory, invoke) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """A masked ticket trained under DP on DIGITS: tickets from MNIST-free digits data → winner → model."""
    folder = tmp_path_factory.mktemp("model")
    data = ["--data-dir", str(data_root)]
    invoke("generate", "--dataset", "digits", "--rounds", "2", "--iterations", "30", "--batch-size", "32",
           "--out", str(folder / "t.pt"), *data, *FAST)
    invoke("select", "--best", "--tickets", str(folder / "t.pt"), "--out", str(folder / "w.pt"))
    report = invoke("train", "--ticket", str(folder / "w.pt"), "--dataset", "digits", "--eps", "2", "--epochs", "2",
                    "--batch-size", "64", "--out", str(folder / "m.pt"), *data, *FAST)
    return folder / "m.pt", report


def test_every_checkpoint_records_the_versions_that_made_it(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    import lightning

    model, _ = trained
    for path in (model, model.with_name("t.pt"), model.with_name("w.pt")):
        environment = torch.load(path, weights_only=True)["environment"]
        assert environment["torch"] == torch.__version__.split("+")[0] or environment["torch"] == torch.__version__
        assert environment["lightning"] == lightning.__version__ and environment["dpltm"]
        assert {"dp-accounting", "numpy", "python"} <= set(environment)


def test_export_holds_the_released_weights_masks_normalisation_and_privacy(trained, tmp_path: Path, invoke) -> None:  # type: ignore[no-untyped-def]
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, report = trained
    out = tmp_path / "m.safetensors"
    shown = invoke("export", "--model", str(model), "--out", str(out))
    body = load_checkpoint(model, "model")
    tensors = load_file(str(out))  # plain safetensors: no dpltm needed to read it
    assert set(tensors) == set(body["state_dict"])
    for name, tensor in body["state_dict"].items():
        assert torch.equal(tensors[name], tensor), name
    masks = {k: v for k, v in tensors.items() if k.startswith("mask_")}
    assert masks and all(m.dtype == torch.bool for m in masks.values())
    pruned = 0
    for name, mask in masks.items():
        weight = tensors[name.removeprefix("mask_").removesuffix("_weight").replace("_", ".") + ".weight"]
        assert torch.count_nonzero(weight[~mask]) == 0  # pruned weights are exactly zero
        pruned += int((~mask).sum())
    assert pruned > 0  # the winner is a real ticket
    with safe_open(str(out), framework="pt") as handle:
        metadata = handle.metadata()
    statement = load_trained_model(model).privacy.statement
    assert metadata["privacy_statement"] == statement
    privacy = json.loads(metadata["privacy"])
    assert privacy["epsilon"] == report["epsilon"] == "inf" and privacy["end_to_end_dp"] is False  # same-data tickets
    assert metadata["privacy_statement"].startswith("NOT end-to-end differentially private")
    assert json.loads(metadata["input_normalisation"])["scale"] == pytest.approx(1 / 16)  # digits: counts / 16
    assert shown["input_normalisation"]["scale"] == pytest.approx(1 / 16)
    assert json.loads(metadata["environment"])["torch"]
    inspected = invoke("inspect", str(out))
    assert inspected["kind"] == "export" and inspected["privacy_statement"] == statement


@pytest.mark.slow
def test_predict_on_an_export_in_a_fresh_process_reproduces_the_test_accuracy(trained, data_root: Path,  # type: ignore[no-untyped-def]
                                                                             tmp_path: Path, invoke) -> None:
    model, report = trained
    exported = tmp_path / "m.safetensors"
    invoke("export", "--model", str(model), "--out", str(exported))
    env = {**os.environ, "DPLTM_DATA_DIR": str(data_root)}
    result = subprocess.run([sys.executable, "-m", "dpltm.cli", "predict", "--model", str(exported), "--out",
                             str(tmp_path / "p.csv"), "--json"], cwd=tmp_path, env=env, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    predicted = json.loads(result.stdout)
    assert predicted["dataset"] == "digits" and predicted["same_data_settings_as_training"] is True
    assert predicted["accuracy"] == pytest.approx(report["test_accuracy"], abs=1e-6)  # the report: float32
    assert predicted["statement"] == load_trained_model(model).privacy.statement
    header, *rows = (tmp_path / "p.csv").read_text().splitlines()
    assert header.split(",")[:3] == ["index", "label", "prediction"] and len(rows) == predicted["records"]
    table = np.array([[float(c) for c in row.split(",")] for row in rows])
    assert np.allclose(table[:, 3:].sum(1), 1.0, atol=1e-4)
    assert (table[:, 3:].argmax(1) == table[:, 2]).all()
    assert (table[:, 1] == table[:, 2]).mean() == pytest.approx(predicted["accuracy"])
    from_checkpoint = invoke("predict", "--model", str(model), "--data-dir", str(data_root))
    assert from_checkpoint["accuracy"] == predicted["accuracy"]


def test_output_mistakes_are_one_line(trained, data_root: Path, tmp_path: Path, cli, invoke, fails) -> None:  # type: ignore[no-untyped-def]
    model, _ = trained
    assert "mnist has 784 features" in fails("predict", "--model", str(model), "--dataset", "mnist", "--data-dir",
                                             str(data_root))
    assert "expected model" in fails("export", "--model", str(model.with_name("t.pt")))
    (tmp_path / "x.safetensors").write_bytes(b"not a safetensors file")
    assert "not a readable safetensors" in fails("predict", "--model", str(tmp_path / "x.safetensors"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    assert "not a dpltm export" in fails("inspect", str(tmp_path / "foreign.safetensors"))
    invoke("export", "--model", str(model), "--out", str(tmp_path / "m.safetensors"))
    assert "--overwrite" in fails("export", "--model", str(model), "--out", str(tmp_path / "m.safetensors"))
    assert ".safetensors" in fails("export", "--model", str(model), "--out", str(tmp_path / "m.bin"))
    bad_choice = cli("predict", "--model", str(model), "--part", "bogus", ok=False)  # main() makes it one line
    assert bad_choice.exit_code == 2 and "'bogus' is not one of" in bad_choice.output


def test_predict_on_the_training_records_needs_an_explicit_opt_in(trained, data_root: Path,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    """Per-record labels and outputs of the private training records are not DP: refused in one line,
    nothing written, unless --expose-training-records (then a warning on stderr and in the JSON)."""
    from tests.cli.test_bad_inputs import _run_in_process, assert_one_line_error, snapshot

    model, _ = trained
    cwd = tmp_path / "work"
    cwd.mkdir()
    exposed = "per-record labels and model outputs of the private training records: not differentially private"
    for extra in ([], ["--out", "p.csv"], ["--out", "p.csv", "--json"]):
        before = snapshot(tmp_path, data_root, model.parent)
        code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--part", "train", *extra], cwd,
                                               data_root)
        assert_one_line_error(code, stdout, stderr, exposed)
        assert "--expose-training-records" in stderr
        assert snapshot(tmp_path, data_root, model.parent) == before
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--part", "train",
                                            "--expose-training-records", "--out", "p.csv", "--json"], cwd, data_root)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["exposes_training_records"] is True and exposed in report["warning"]
    assert "warning: NOT differentially private" in stderr and (cwd / "p.csv").is_file()
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--part", "val", "--json"], cwd,
                                           data_root)
    assert code == 0 and json.loads(stdout)["exposes_training_records"] is False and "warning" not in stderr


def test_another_split_of_the_models_own_data_counts_as_exposing_its_training_records(  # type: ignore[no-untyped-def]
        trained, data_root: Path, tmp_path: Path) -> None:
    """`--split all` re-divides the pool the model was trained on: any part can hold training records, so it
    needs the opt-in like `--part train`. The official test portion under `--split test` cannot (the model
    trained on the training portion) and is predicted as before."""
    from dpltm.stages.predict import pools_apart
    from tests.cli.test_bad_inputs import _run_in_process, assert_one_line_error

    model, _ = trained
    cwd = tmp_path / "work"
    cwd.mkdir()
    for part in ("test", "val"):
        code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--split", "all", "--part", part],
                                               cwd, data_root)
        assert_one_line_error(code, stdout, stderr, f"so its {part} part can hold per-record labels")
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--split", "all", "--part", "test",
                                            "--expose-training-records", "--json"], cwd, data_root)
    assert code == 0 and json.loads(stdout)["exposes_training_records"] is True, stderr
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--split", "test", "--json"], cwd,
                                           data_root)
    assert code == 0 and json.loads(stdout)["exposes_training_records"] is False, stderr
    assert pools_apart("train", "test", "val") and pools_apart("test", "train", "val")
    assert not pools_apart("test", "train", "test") and not pools_apart("train", "all", "test")
    assert not pools_apart("all", "train", "test") and not pools_apart("all", "test", "val")


# ---- run folders ------------------------------------------------------------------------------


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False))
def test_float32_at_least_never_understates(value: float) -> None:
    shown = float32_at_least(value)
    assert shown >= value and float(np.float32(shown)) == shown
    below = float(np.nextafter(np.float32(shown), np.float32(0)))
    assert below < value  # the smallest such float32
    assert float32_at_least(math.inf) == math.inf


def test_concurrent_runs_claim_distinct_version_folders(tmp_path: Path) -> None:
    claimed: list[Path] = []
    threads = [threading.Thread(target=lambda: claimed.append(claim_version_folder(tmp_path / "train" / "d")))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(p.name.split("_")[1]) for p in claimed) == list(range(16))


def test_a_failed_run_says_so_in_its_folder(tmp_path: Path) -> None:
    log = RunLog("train", "digits", "csv", tmp_path, {"train": {"eps2": 1.0}})
    with pytest.raises(ValueError), log.closed_on_error():
        log.log_metrics({"epsilon": 0.5, "val_accuracy": 0.7}, step=10)
        raise ValueError("boom")
    run = json.loads((log.folder / "run.json").read_text())
    assert run["status"] == "failed" and run["error"] == "boom" and run["settings"] == {"train": {"eps2": 1.0}}
    assert (log.folder / "metrics.csv").read_text().splitlines()[0].split(",") == ["epsilon", "step", "val_accuracy"]
    assert (log.folder / "hparams.yaml").exists()
    second = RunLog("train", "digits", "none", tmp_path)
    assert second.folder.name == "version_1" and sorted(p.name for p in second.folder.iterdir()) == ["run.json"]


def test_generate_and_a_dp_run_log_through_lightning(data_root: Path, tmp_path: Path, invoke) -> None:
    logs = tmp_path / "logs"
    common = ["--data-dir", str(data_root), "--log-dir", str(logs), *FAST]
    invoke("generate", "--dataset", "digits", "--rounds", "1", "--iterations", "200", "--batch-size", "32",
           "--out", str(tmp_path / "t.pt"), *common)
    run = json.loads((logs / "generate" / "digits" / "version_0" / "run.json").read_text())
    tickets = load_checkpoint(tmp_path / "t.pt", "tickets")["tickets"]
    assert run["status"] == "finished" and [t["density"] for t in run["tickets"]] == [t["density"] for t in tickets]
    header, *rows = (logs / "generate" / "digits" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "train_loss" in header and len(rows) >= 4  # the loss curve, at its global SGD steps
    report = invoke("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "3", "--batch-size", "64",
                    "--out", str(tmp_path / "d.pt"), *common)
    folder = Path(report["log_dir"])
    assert folder == logs / "train" / "digits" / "version_0"
    header, *rows = (folder / "metrics.csv").read_text().splitlines()
    # only what the released model and the accountant determine: no training loss of private batches
    assert set(header.split(",")) == {"epoch", "steps", "step", "val_accuracy", "test_accuracy", "epsilon"}
    history = load_checkpoint(tmp_path / "d.pt", "model")["history"]
    logged = [float(r.split(",")[header.split(",").index("epsilon")]) for r in rows]
    assert all(shown >= h["epsilon"] for shown, h in zip(logged, history, strict=True))
    again = invoke("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "1", "--batch-size", "64",
                   "--out", str(tmp_path / "d2.pt"), *common)
    assert Path(again["log_dir"]).name == "version_1" and (folder / "metrics.csv").exists()  # never overwritten


def test_late_rewound_rounds_log_at_their_own_steps(data_root: Path, tmp_path: Path, invoke) -> None:
    """With --rewind-step K the rounds after the first train I − K steps: each round's end is logged where it fell."""
    logs = tmp_path / "logs"
    invoke("generate", "--dataset", "digits", "--rounds", "2", "--iterations", "200", "--rewind-step", "50",
           "--batch-size", "32", "--out", str(tmp_path / "t.pt"), "--data-dir", str(data_root), "--log-dir", str(logs),
           *FAST)
    header, *rows = (logs / "generate" / "digits" / "version_0" / "metrics.csv").read_text().splitlines()
    names = header.split(",")
    ends = {int(float(r.split(",")[names.index("round")])): int(float(r.split(",")[names.index("step")]))
            for r in rows if r.split(",")[names.index("round")]}
    assert ends == {0: 200, 1: 350, 2: 500}


def test_a_dp_run_logs_to_tensorboard(data_root: Path, tmp_path: Path, invoke) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = invoke("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "2", "--batch-size", "64",
                    "--logger", "tensorboard", "--log-dir", str(tmp_path / "tb"), "--out", str(tmp_path / "d.pt"),
                    "--data-dir", str(data_root), *FAST)
    folder = Path(report["log_dir"])
    assert any(p.name.startswith("events.out.tfevents") for p in folder.iterdir())
    events = EventAccumulator(str(folder))
    events.Reload()
    assert {"epsilon", "val_accuracy", "test_accuracy"} <= set(events.Tags()["scalars"])
    epsilons = [e.value for e in events.Scalars("epsilon")]
    history = load_checkpoint(tmp_path / "d.pt", "model")["history"]
    assert len(epsilons) == 2 and all(s >= h["epsilon"] for s, h in zip(epsilons, history, strict=True))
    assert json.loads((folder / "run.json").read_text())["logger"] == "tensorboard"


def test_log_dir_mistakes_are_one_line(data_root: Path, tmp_path: Path, fails) -> None:
    (tmp_path / "file").write_text("")
    assert "not a directory" in fails("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "1",
                                      "--log-dir", str(tmp_path / "file"), "--out", str(tmp_path / "d.pt"),
                                      "--data-dir", str(data_root), *FAST)
    assert not (tmp_path / "d.pt").exists()


def test_a_log_root_from_the_environment_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad $DPLTM_LOG_DIR is named as the variable, not as a --log-dir the user never passed."""
    from dpltm.run_log import LOG_DIR_ENV, check_log_root

    (tmp_path / "file").write_text("")
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "file"))
    with pytest.raises(DpltmUserError, match=rf"^\${LOG_DIR_ENV} .*file is not a directory$"):
        check_log_root(None)
    with pytest.raises(DpltmUserError, match=r"^--log-dir .*file is not a directory$"):
        check_log_root(tmp_path / "file")


def test_run_log_refuses_an_unknown_logger(tmp_path: Path) -> None:
    with pytest.raises(DpltmUserError, match="--logger must be one of"):
        RunLog("train", "digits", "wandb", tmp_path)


def test_a_dp_run_logs_to_mlflow(data_root: Path, tmp_path: Path, invoke) -> None:
    """Where MLflow is installed (the `mlflow` extra; not in the test extra: it is heavy)."""
    mlflow = pytest.importorskip("mlflow")
    logs = tmp_path / "logs"
    report = invoke("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "2", "--batch-size", "64",
                    "--logger", "mlflow", "--log-dir", str(logs), "--out", str(tmp_path / "d.pt"),
                    "--data-dir", str(data_root), *FAST)
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{(logs / 'mlflow.db').resolve()}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "dpltm-train-digits"]
    (run,) = client.search_runs([experiment.experiment_id])
    epsilons = [m.value for m in client.get_metric_history(run.info.run_id, "epsilon")]
    history = load_checkpoint(tmp_path / "d.pt", "model")["history"]
    assert len(epsilons) == 2 and all(s >= h["epsilon"] for s, h in zip(epsilons, history, strict=True))
    assert run.info.status == "FINISHED" and Path(report["log_dir"]).name == "version_0"


def test_tensorboard_never_shows_less_than_the_epsilon_spent(tmp_path: Path) -> None:
    """0.7 is a value float32 rounds *down* (to 0.69999999): the log must show at least 0.7."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert float(np.float32(0.7)) < 0.7
    log = RunLog("train", "digits", "tensorboard", tmp_path)
    log.log_metrics({"epsilon": 0.7, "epsilon_dp_part": 0.7, "val_accuracy": 0.7}, step=1)
    log.finish()
    events = EventAccumulator(str(log.folder))
    events.Reload()
    assert events.Scalars("epsilon")[0].value >= 0.7 and events.Scalars("epsilon_dp_part")[0].value >= 0.7
    assert events.Scalars("val_accuracy")[0].value < 0.7  # accuracies are not rounded up


def test_non_private_and_patience_runs_never_log_a_bare_epsilon(data_root: Path, tmp_path: Path, invoke) -> None:
    common = ["--dataset", "digits", "--epochs", "3", "--batch-size", "64", "--data-dir", str(data_root),
              "--log-dir", str(tmp_path / "logs"), *FAST]
    plain = invoke("train", "--dense", "--non-private", "--out", str(tmp_path / "n.pt"), *common)
    header = (Path(plain["log_dir"]) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "epsilon" not in header and "epsilon_dp_part" not in header  # no ε at all: nothing was spent
    run = json.loads((Path(plain["log_dir"]) / "run.json").read_text())
    assert run["mode"] == "non-private" and run["end_to_end_dp"] is False and len(run["history"]) == 3
    patient = invoke("train", "--dense", "--eps", "1", "--patience", "1", "--out", str(tmp_path / "p.pt"), *common)
    header, *rows = (Path(patient["log_dir"]) / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("epsilon_dp_part")
    assert "epsilon" not in header.split(",")
    planned = [float(r.split(",")[column]) for r in rows]
    assert all(value >= 0.999 for value in planned)  # the planned run's bound, however early it stops
    run = json.loads((Path(patient["log_dir"]) / "run.json").read_text())
    assert run["end_to_end_dp"] is False and all(r["epsilon_dp_part"] >= 0.999 for r in run["history"])
    quiet = invoke("train", "--dense", "--eps", "1", "--logger", "none", "--out", str(tmp_path / "q.pt"), *common)
    assert sorted(p.name for p in Path(quiet["log_dir"]).iterdir()) == ["run.json"]


def test_a_refused_run_leaves_no_log_folder(data_root: Path, tmp_path: Path, cli, invoke) -> None:
    invoke("train", "--dense", "--dataset", "digits", "--eps", "1", "--epochs", "1", "--data-dir", str(data_root),
           "--log-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "d.pt"), *FAST)
    refused = cli("train", "--dense", "--dataset", "digits", "--eps", "1", "--noise", "shaped",
                  "--data-dir", str(data_root), "--log-dir", str(tmp_path / "logs"),
                  "--out", str(tmp_path / "s.pt"), *FAST, ok=False)
    assert refused.exit_code == 2, refused.output
    assert sorted(p.name for p in (tmp_path / "logs" / "train" / "digits").iterdir()) == ["version_0"]


def test_a_private_ticket_plan_with_the_0_1_0_key_is_refused_in_one_line() -> None:
    """The 0.1.0 alias train.target_eps is gone (checkpoint format 2): a plan carrying it is a
    one-line error naming the key, not a silent default."""
    import dataclasses

    from dpltm.config import resolve_train_config
    from dpltm.errors import DpltmUserError
    from dpltm.tickets.private import private_ticket_plan
    from tests.core.bodies import private_ticket

    made = private_ticket()
    ticket = dataclasses.replace(made, source={**made.source, "config": {
        "train": {"target_eps": None, "epochs": 5}, "data": {"dataset": "digits"}}})
    with pytest.raises(DpltmUserError, match="unknown config key.*target_eps"):
        resolve_train_config({"data": {"dataset": "digits"}}, None, base=private_ticket_plan(ticket))


def test_predict_flags_that_would_do_nothing_are_refused(  # type: ignore[no-untyped-def]
        trained, data_root: Path, tmp_path: Path) -> None:
    """--expose-training-records where no training record is exposed, and --overwrite with no --out: each would
    be silently ignored (and the first suggests an exposure that did not happen)."""
    from tests.cli.test_bad_inputs import _run_in_process, assert_one_line_error

    model, _ = trained
    cwd = tmp_path / "work"
    cwd.mkdir()
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--part", "test",
                                            "--expose-training-records"], cwd, data_root)
    assert_one_line_error(code, stdout, stderr, "holds none of the model's training records: drop the flag")
    code, stdout, stderr = _run_in_process(["predict", "--model", str(model), "--overwrite"], cwd, data_root)
    assert_one_line_error(code, stdout, stderr, "no --out was given")
    assert list(cwd.iterdir()) == []
