"""Smoke test of the reproduction on small files: every method runs, results resume, docs render."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml
from grid import PROFILES, experiment

from dpltm.errors import DpltmUserError
from tests.datafiles import write_digits, write_mnist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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


def test_sound_modes_grid_with_recipe_choices_and_private_tickets(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue-9 grid: noise-aware public tickets (choice prepared once per plan, on public data
    only), private tickets and dense DP-SGD under one recipe (tanh, EMA); same-data on fewer seeds."""
    loaded: list[str] = []
    real_load = experiment.load_dataset

    def recording_load(name: str, **kwargs: object) -> object:
        loaded.append(name)
        return real_load(name, **kwargs)

    monkeypatch.setattr(experiment, "load_dataset", recording_load)
    data = tmp_path / "data"
    write_digits(data)
    write_mnist(data, "MNIST", n_train=60, n_test=20)
    profile = {**PROFILE, "seeds": [0, 1], "methods": ["dpltm-noise-aware", "dpltm-private", "dpsgd", "dpltm-same"],
               "method_seeds": {"dpltm-same": [0]}, "model": {"activation": "tanh"},
               "train": {"epochs": 3, "batch_size": 16, "clip": 1.0, "lr": 0.1, "ema": 0.9},
               "noise_aware": {"rounds": [0, 2]}, "private_ticket": {"warmup_epochs": 1, "density": 0.3},
               "small_dataset": {"lr": 0.2}}
    del profile["random_ticket_eps"]
    path = tmp_path / "sound.yaml"
    path.write_text(yaml.safe_dump(profile))
    out = tmp_path / "out"
    common = ["--profile", str(path), "--out", str(out), "--data-dir", str(data)]
    reproduce.main([*common, "--prepare", "--shard", "0/2"])
    reproduce.main([*common, "--prepare", "--shard", "1/2"])
    choices = sorted((out / "choices").glob("*.json"))
    assert len(choices) == 2  # one per ε; nothing trained privately yet
    assert not list(out.glob("results-*.csv"))
    reproduce.main([*common, "--doc", str(tmp_path / "doc.md")])
    with (out / "results-0of1.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted({(r["method"], r["seed"]) for r in rows}) == sorted(
        [(m, s) for m in ("dpltm-noise-aware", "dpltm-private", "dpsgd") for s in ("0", "1")] + [("dpltm-same", "0")])
    assert len(choices) == len(list((out / "choices").glob("*.json")))  # the grid reused the prepared choices
    for r in rows:
        assert float(r["epsilon"]) <= float(r["epsilon_target"]) + 1e-9
        assert r["end_to_end_dp"] == ("False" if r["method"] == "dpltm-same" else "True")
        if r["method"] == "dpltm-private":
            assert 0.25 < float(r["density"]) < 0.35 and float(r["prep_seconds"]) > 0
    doc = (tmp_path / "doc.md").read_text()
    assert "private tickets" in doc and "against dense DP-SGD" in doc
    # the public tickets' data (MNIST) was loaded, and the private set (digits); ISOLET was only
    # looked for (absent, optional)
    assert set(loaded) == {"digits", "mnist", "isolet"}


def test_results_file_with_other_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results-0of1.csv"
    old_fields = [f for f in experiment.RESULT_FIELDS if f not in ("noise_seed", "selection_seed")]
    experiment.append_row(path, old_fields, dict.fromkeys(old_fields, "x"))
    with pytest.raises(DpltmUserError, match="written by another version"):
        experiment.append_row(path, experiment.RESULT_FIELDS, dict.fromkeys(experiment.RESULT_FIELDS, "y"))
    experiment.append_row(path, old_fields, dict.fromkeys(old_fields, "z"))  # same columns: appended
    assert len(path.read_text().splitlines()) == 3


def test_recipe_search_reads_only_the_public_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuned profile's search never opens the private dataset: only its size enters (σ is
    calibrated for q = L/N with the private N, not the public set's)."""
    import tune_recipe

    from dpltm.privacy.calibration import calibrate_noise_multiplier

    loaded: list[tuple[str, str]] = []
    real_load = tune_recipe.load_dataset

    def recording_load(name: str, **kwargs: object) -> object:
        loaded.append((name, str(kwargs.get("split"))))
        return real_load(name, **kwargs)

    monkeypatch.setattr(tune_recipe, "load_dataset", recording_load)
    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=200, n_test=20)
    out = tmp_path / "search.csv"
    tune_recipe.main(["--public", "mnist:train", "--private-size", "54000", "--eps", "1", "--activations", "tanh",
                      "--batch-epochs", "100x1", "--lrs", "0.1", "0.4", "--data-dir", str(data), "--out", str(out),
                      "--hidden", "8"])
    assert loaded == [("mnist", "train")]
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 6  # two rates × (final iterate + three EMA decays + two with a warm-up)
    sigma = calibrate_noise_multiplier(100 / 54000, 540, 1.0, 1e-5)
    assert {float(r["sigma"]) for r in rows} == {round(sigma, 5)}
    assert all(0.0 <= float(r["public_val_accuracy"]) <= 1.0 for r in rows)


def _run_tiny_profile(tmp_path: Path, profile: dict[str, object], out: Path) -> list[dict[str, str]]:
    """`profile` run by reproduce.py on tiny MNIST (private) and KMNIST (public) files; its result rows.
    The report goes to tmp_path/d.md."""
    data = tmp_path / "data"
    write_mnist(data, "MNIST", n_train=120, n_test=30)
    write_mnist(data, "KMNIST", n_train=120, n_test=30)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    reproduce.main(["--profile", str(path), "--out", str(out), "--data-dir", str(data),
                    "--doc", str(tmp_path / "d.md")])
    with (out / "results-0of1.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_cnn_profile_runs_lenet5_tickets_and_the_dense_cnn(tmp_path: Path) -> None:
    """The grid with `model: {arch: lenet5}`: CNN tickets from public data, the dense CNN under DP-SGD."""
    shipped = yaml.safe_load((PROFILES / "cnn.yaml").read_text())
    assert shipped["model"]["arch"] == "lenet5"
    profile = {**shipped, "epsilons": [1.0], "seeds": [0], "generate": {**shipped["generate"], "rounds": 1,
                                                                         "iterations": 5, "batch_size": 16},
               "train": {"epochs": 1, "batch_size": 16, "clip": 1.0, "lr": 0.1}}
    out = tmp_path / "out"
    rows = _run_tiny_profile(tmp_path, profile, out)
    assert {r["method"] for r in rows} == {"dpltm-public", "dpsgd"} and all(r["end_to_end_dp"] == "True" for r in rows)
    tickets = next((out / "tickets").glob("kmnist-*.pt"))
    from dpltm.checkpoint import load_checkpoint

    assert load_checkpoint(tickets, "tickets")["architecture"]["conv"] == [[6, 5], [16, 5]]


def test_public_start_profile_fine_tunes_the_dense_public_network_and_keeps_dpsgd_at_theta0(tmp_path: Path) -> None:
    """Issue 21's baselines get the public data too: `dpsgd-public` trains the public tickets' dense round 0 from
    its public weights, `dpsgd` stays at θ0 although the profile says `rewind: public`, and the noise-aware
    winner and the random-mask control start from public weights; every row is end-to-end DP."""
    shipped = yaml.safe_load((PROFILES / "public-start.yaml").read_text())
    assert shipped["train"]["rewind"] == "public" and "dpsgd-public" in shipped["methods"]
    profile = {**shipped, "epsilons": [1.0], "seeds": [0], "datasets": [{"name": "mnist", "split": "train"}],
               "generate": {**shipped["generate"], "rounds": 2, "iterations": 5, "batch_size": 16},
               "noise_aware": {"rounds": [0, 1]},
               "train": {**shipped["train"], "epochs": 1, "batch_size": 16}}
    out = tmp_path / "out"
    rows = {r["method"]: r for r in _run_tiny_profile(tmp_path, profile, out)}
    assert set(rows) == {"dpltm-noise-aware", "dpsgd-public", "dpsgd", "random-mask"}
    assert all(r["end_to_end_dp"] == "True" for r in rows.values())
    assert float(rows["dpsgd-public"]["density"]) == 1.0 and rows["dpsgd-public"]["ticket_round"] == "0"
    from dpltm.checkpoint import load_checkpoint

    models = out / "models"
    fine_tuned = load_checkpoint(models / "mnist-dpsgd-public-1-0.pt", "model")
    assert fine_tuned["transfer"]["rewind"] == "public" and fine_tuned["transfer"]["activation"] == "tanh"
    assert "activation_override" not in fine_tuned["transfer"]  # the tickets were made in tanh too
    assert load_checkpoint(models / "mnist-dpsgd-1-0.pt", "model").get("ticket") is None
    assert "fine-tuning" in (tmp_path / "d.md").read_text()


def test_a_profiles_ema_warmup_needs_a_decay(tmp_path: Path) -> None:
    """A profile (or a per-dataset override) that asks for the warm-up without a decay is refused, not run with
    the final iterate."""
    shipped = yaml.safe_load((PROFILES / "public-start-ema.yaml").read_text())
    profile = {**shipped, "dataset_train": {"mnist": {"ema": None}}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    import torch
    from grid.experiment import Experiment

    exp = Experiment.from_file(path, tmp_path / "out", tmp_path, torch.device("cpu"))
    assert exp.train_settings(54000, "fashion-mnist").ema_warmup
    with pytest.raises(DpltmUserError, match="train.ema_warmup needs a decay, train.ema \\(for mnist\\)"):
        exp.train_settings(54000, "mnist")


def test_a_profiles_search_trains_the_winner_as_its_choice_chose(tmp_path: Path) -> None:
    """`noise_aware: {search: [...]}` widens the grid's choice (issue 21, item 3) and the run trains the winner
    with the variant the choice recorded; the shipped CNN grid runs LeNet-5 tickets from their public weights."""
    shipped = yaml.safe_load((PROFILES / "cnn-public.yaml").read_text())
    assert shipped["model"]["arch"] == "lenet5" and shipped["train"]["rewind"] == "public"
    profile = {**shipped, "epsilons": [1.0], "seeds": [0], "methods": ["dpltm-noise-aware"],
               "generate": {**shipped["generate"], "rounds": 1, "iterations": 5, "batch_size": 16},
               "noise_aware": {"rounds": [0, 1], "search": ["start", "release"]},
               "train": {**shipped["train"], "epochs": 1, "batch_size": 16}}
    out = tmp_path / "out"
    rows = _run_tiny_profile(tmp_path, profile, out)
    assert [r["method"] for r in rows] == ["dpltm-noise-aware"] and rows[0]["end_to_end_dp"] == "True"
    from dpltm.checkpoint import load_checkpoint

    model = load_checkpoint(out / "models" / "mnist-dpltm-noise-aware-1-0.pt", "model")
    choice = model["ticket"]["selection"]["noise_aware"]
    assert choice["searched"] == ["start", "release"] and len(choice["candidates"]) == 2 * 2 * 2
    trained = model["config"]["train"]
    assert (trained["rewind"], trained["ema"]) == (choice["chosen"]["start"], choice["chosen"]["ema"])
