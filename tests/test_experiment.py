"""Smoke test of the reproduction on small files: every method runs, results resume, docs render."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml
from datafiles import write_digits, write_mnist

from dpltm import experiment
from dpltm.errors import DpltmUserError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import reproduce  # noqa: E402

PROFILE = {
    "name": "tiny",
    "epsilons": [1.0, 0.5],
    "delta": 1e-5,
    "seeds": [0],
    "selection_fraction": 0.1,
    "nu": 50,
    "methods": ["dpltm-same", "dpltm-public", "dpsgd", "nonprivate"],
    "datasets": [{"name": "digits", "split": "train"}, {"name": "isolet", "split": "train", "optional": True}],
    "public": {"default": {"name": "mnist", "split": "train"}},
    "random_ticket_eps": 0.5,
    "curve_eps": 1.0,
    "generate": {"rounds": 2, "iterations": 10, "batch_size": 32, "lr": 0.1},
    "train": {"epochs": 2, "batch_size": 16, "clip": 1.0, "lr": 0.1},
    "small_dataset_batch": 16,
}


def test_reproduction_runs_resumes_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    noise_seeds: list[object] = []
    real_train = experiment.train

    def recording_train(*args: object, **kwargs: object) -> dict:
        noise_seeds.append(kwargs.get("noise_seed", "missing"))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(experiment, "train", recording_train)
    data = tmp_path / "data"
    write_digits(data)
    write_mnist(data, "MNIST", n_train=60, n_test=20)
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    out = tmp_path / "out"
    args = ["--profile", str(profile), "--out", str(out), "--data-dir", str(data), "--doc", str(tmp_path / "doc.md")]
    reproduce.main(args)
    with (out / "results-0of1.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    # 2 ε × 3 private methods + non-private + random ticket; ISOLET is absent and optional
    assert len(rows) == 8 and {r["dataset"] for r in rows} == {"digits"}
    by_method = {(r["method"], r["epsilon_target"]): r for r in rows}
    assert by_method[("dpltm-same", "1")]["end_to_end_dp"] == "False"
    assert by_method[("dpltm-public", "1")]["end_to_end_dp"] == "True"
    assert float(by_method[("dpsgd", "0.5")]["epsilon"]) <= 0.5
    assert float(by_method[("dpltm-same", "0.5")]["epsilon"]) <= 0.5 + 1e-9  # ε1 + ε2 composed
    # Every run gets a fresh OS-CSPRNG noise seed (None), so no two ε share noise draws; the
    # rows say so and never hold a seed.
    assert noise_seeds == [None] * 8
    for r in rows:
        private = r["method"] != "nonprivate"
        assert r["noise_seed"] == ("csprng" if private else "")
        assert r["selection_seed"] == ("csprng" if r["method"] == "dpltm-same" else "")
    reproduce.main(args)  # resumes: nothing runs twice
    with (out / "results-0of1.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 8
    doc = (tmp_path / "doc.md").read_text()
    assert "NOT end-to-end DP" in doc and "digits" in doc
    assert (tmp_path / "fig1_accuracy_vs_eps.png").stat().st_size > 0


def test_results_file_with_other_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results-0of1.csv"
    old_fields = [f for f in experiment.RESULT_FIELDS if f not in ("noise_seed", "selection_seed")]
    experiment.append_row(path, old_fields, dict.fromkeys(old_fields, "x"))
    with pytest.raises(DpltmUserError, match="written by another version"):
        experiment.append_row(path, experiment.RESULT_FIELDS, dict.fromkeys(experiment.RESULT_FIELDS, "y"))
    experiment.append_row(path, old_fields, dict.fromkeys(old_fields, "z"))  # same columns: appended
    assert len(path.read_text().splitlines()) == 3
