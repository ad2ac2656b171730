"""What a newcomer meets (issue 19 §4): a bar with an ETA on stderr for every long phase, `run`'s
settings checked against the data before any work, the result on stdout, `inspect` as tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpltm.checkpoint import load_checkpoint
from tests.datafiles import write_digits, write_mnist

FAST_GEN = ["--rounds", "1", "--iterations", "15", "--batch-size", "16", "--device", "cpu"]
ETA = re.compile(r"\d\d:\d\d<\d\d:\d\d")  # tqdm's [elapsed<remaining]
REPR = re.compile(r"\{|\['|\[-?\d|\[\]|': ")  # a dict's or a list's repr (a statement may hold "[scope]")


def bars(stderr: str, phase: str) -> list[str]:
    """The updates of the bars named `phase` (tqdm's, each with [elapsed<remaining])."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.startswith(phase) and ETA.search(line)]


def values_of(word: str, tree: object):  # type: ignore[no-untyped-def]
    """Every float under a key holding `word`, anywhere in a JSON tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if word in key and isinstance(value, float):
                yield value
            yield from values_of(word, value)
    elif isinstance(tree, list):
        for value in tree:
            yield from values_of(word, value)


def flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at the console's width


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_digits(root)
    write_mnist(root, "MNIST", n_train=120, n_test=30)
    return root


@pytest.fixture(scope="module")
def digits_tickets(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:
    out = tmp_path_factory.mktemp("tickets") / "t.pt"
    cli("generate", "--dataset", "digits", "--data-dir", str(data_root), *FAST_GEN, "--no-progress",
        "--out", str(out))
    return out


def test_the_noise_aware_choice_shows_a_bar_with_its_name_and_eta(digits_tickets: Path, data_root: Path,
                                                                  tmp_path: Path, cli) -> None:
    planned = ["--noise-aware", "--private-size", "400", "--sigma", "1", "--epochs", "1", "--batch-size", "16",
               "--data-dir", str(data_root), "--device", "cpu", "--tickets", str(digits_tickets)]
    shown = cli("select", *planned, "--out", str(tmp_path / "w.pt"))
    assert "25/25" in bars(shown.stderr, "noise-aware choice")[-1], shown.stderr
    quiet = cli("select", *planned, "--out", str(tmp_path / "w2.pt"), "--no-progress")
    assert "noise-aware choice:" in quiet.stderr  # the announcement, not a bar
    assert not ETA.search(quiet.stderr)


def test_run_shows_every_phase_and_prints_its_result_on_stdout(data_root: Path, tmp_path: Path, cli) -> None:
    from dpltm.privacy.calibration import _calibrated_dpsgd

    _calibrated_dpsgd.cache_clear()
    out = tmp_path / "m.pt"
    result = cli("run", "--dataset", "digits", "--public-dataset", "mnist", "--public-split", "train",
                 "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "2",
                 "--batch-size", "64", "--lr", "0.05", "--clip", "0.5", "--device", "cpu", "--out", str(out),
                 "--neighbouring", "replace-one")
    for phase in ("round 0/1", "round 1/1", "noise-aware choice", "DP training epoch 1/2", "DP training epoch 2/2"):
        assert bars(result.stderr, phase), (phase, result.stderr)
    stdout = flat(result.stdout)
    assert re.search(r"test accuracy \d\.\d{4}", stdout) and "-DP" in stdout and "model:" in stdout
    assert "test accuracy" not in result.stderr and not ETA.search(result.stdout)
    assert load_checkpoint(out, "model")["privacy"]["ledger"]["neighboring"] == "replace_one"
    assert "replace-one" in stdout
    config = load_checkpoint(out, "model")["config"]["train"]
    assert (config["lr"], config["clip"]) == (0.05, 0.5)  # run --lr/--clip reach the training
    winner = load_checkpoint(out.with_name("m-winner.pt"), "ticket")
    assert winner["selection"]["noise_aware"]["plan"]["clip"] == 0.5  # and the noise-aware plan
    # σ calibrated once: the plan check, the noise-aware choice and the training share the one search
    calibrations = _calibrated_dpsgd.cache_info()
    assert (calibrations.misses, calibrations.hits) == (1, 2), calibrations
    assert winner["selection"]["noise_aware"]["plan"]["noise_multiplier"] == load_checkpoint(out, "model")[
        "privacy"]["ledger"]["training"]["sigma"]


def test_run_with_private_tickets_calibrates_its_phases_once(data_root: Path, tmp_path: Path, cli) -> None:
    """The check before any work, the warm-up and the training of `run --ticket-source private` plan
    the same phases: one σ search for the shared plan."""
    from dpltm.privacy.calibration import _calibrated_phases

    _calibrated_phases.cache_clear()
    out = tmp_path / "m.pt"
    cli("run", "--dataset", "digits", "--ticket-source", "private", "--data-dir", str(data_root), "--epochs", "2",
        "--warmup-epochs", "1", "--batch-size", "64", "--device", "cpu", "--no-progress", "--out", str(out))
    calibrations = _calibrated_phases.cache_info()
    assert calibrations.misses == 1 and calibrations.hits >= 1, calibrations
    ledger = load_checkpoint(out, "model")["privacy"]["ledger"]
    # training is calibrated after the warm-up that ran: never more noise than planned
    assert ledger["training"]["sigma"] <= ledger["phase1_training"][0]["sigma"]


def test_run_checks_the_recipe_against_the_data_before_any_work(data_root: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, cli) -> None:
    import dpltm.stages.run

    def no_work(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a stage ran before the settings were checked")

    for stage in ("stage_generate", "stage_generate_private", "stage_select", "stage_train"):
        monkeypatch.setattr(dpltm.stages.run, stage, no_work)
    for args, message in (
        (["--recipe", "tuned"], "batch size 1600 (recipe tuned) must be smaller than digits's training set"),
        (["--batch-size", "110"], "public training set the noise-aware choice trains on (109 records)"),
        (["--config", "noise.yaml"], "noise shaped needs public data"),
        (["--eps", "1e-6"], "cannot"),
        (["--recipe", "tuned", "--lr", "0.1"], "--lr 0.1 would be ignored: recipe tuned"),
        (["--recipe", "tuned", "--lr", "0.1", "--ticket-source", "private"], "--lr 0.1 would be ignored"),
    ):
        (tmp_path / "noise.yaml").write_text("train:\n  noise: shaped\n")
        public = [] if "private" in args else ["--public-dataset", "mnist", "--public-split", "train"]  # public only
        result = cli("run", "--dataset", "digits", *public, "--data-dir", str(data_root), "--device", "cpu",
                     "--out", str(tmp_path / "out" / "m.pt"), *[a.replace("noise.yaml", str(
                         tmp_path / "noise.yaml")) for a in args], ok=False)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dpltm: error:") and message in lines[0], (args, lines)
        assert result.stdout == "" and not (tmp_path / "out").exists()


def test_train_and_private_generate_print_their_result_on_stdout(data_root: Path, tmp_path: Path, cli) -> None:
    train = ["train", "--dense", "--dataset", "digits", "--data-dir", str(data_root), "--epochs", "1",
             "--batch-size", "32", "--device", "cpu", "--eps", "1"]
    shown = cli(*train, "--out", str(tmp_path / "m.pt"))
    assert re.search(r"test accuracy \d\.\d{4}", shown.stdout) and "-DP" in flat(shown.stdout)
    assert bars(shown.stderr, "DP training")
    as_json = cli(*train, "--out", str(tmp_path / "m2.pt"), "--json", "--no-progress")
    assert json.loads(as_json.stdout)["test_accuracy"] >= 0  # JSON alone on stdout
    assert "test accuracy" in as_json.stderr
    private = cli("generate", "--private", "--dataset", "digits", "--data-dir", str(data_root), "--epochs", "2",
                  "--warmup-epochs", "1", "--batch-size", "32", "--eps", "1", "--device", "cpu",
                  "--out", str(tmp_path / "p.pt"))
    assert re.search(r"validation accuracy \d\.\d{4}", private.stdout) and "-DP" in flat(private.stdout)
    assert bars(private.stderr, "DP warm-up round 1/1"), private.stderr
    assert not ETA.search(private.stdout)


def test_inspect_shows_tables_without_reprs_and_accuracies_to_4_digits(digits_tickets: Path, data_root: Path,
                                                                      tmp_path: Path, cli) -> None:
    winner, model = tmp_path / "w.pt", tmp_path / "m.pt"
    cli("select", "--best", "--tickets", str(digits_tickets), "--out", str(winner))
    report = json.loads(cli("train", "--ticket", str(winner), "--dataset", "digits", "--data-dir", str(data_root),
                            "--epochs", "1", "--batch-size", "64", "--eps", "1", "--device", "cpu",
                            "--no-progress", "--out", str(model), "--json").stdout)
    for path in (digits_tickets, winner, model):
        shown = cli("inspect", str(path)).stdout
        assert not REPR.search(shown) and "│" in shown, shown  # rich tables, no reprs
        accuracies = list(values_of("accuracy", json.loads(cli("inspect", str(path), "--json").stdout)))
        # each shown to 4 digits, never as its full repr (0.75 is shown "0.7500": a repr must not be a prefix)
        assert accuracies and all(f"{v:.4f}" in shown and not re.search(rf"{re.escape(repr(v))}(?!\d)", shown)
                                  for v in accuracies), shown
    shown = cli("inspect", str(model)).stdout
    assert f"{report['test_accuracy']:.4f}" in shown and "(ε = " in shown


def test_inspect_reads_a_library_run(tmp_path: Path, cli) -> None:
    import torch

    import dpltm

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 10, generator=g), torch.randint(0, 3, (300,), generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    run = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                             batch_size=30, epochs=2)
    run.fit(val=(x, y))
    path = run.save(tmp_path / "run.pt")
    as_json = json.loads(cli("inspect", str(path), "--json").stdout)
    assert as_json["kind"] == "run" and as_json["statement"] == run.report()["statement"]
    assert [s["steps"] for s in as_json["segments"]] == [20] and [h["epoch"] for h in as_json["history"]] == [1, 2]
    assert as_json["ledger"]["epsilon"] == run.epsilon
    shown = cli("inspect", str(path)).stdout
    assert "spent segments" in shown and "history" in shown and not REPR.search(shown)
    assert flat(run.report()["statement"]) in flat(shown)
    assert re.search(r"│\s+2 │\s+20 │\s+[\d.]+ │\s+\d\.\d{4} │", shown)  # epoch 2: steps, ε, val accuracy
    model.load_state_dict(start)  # other weights: a new run (the trained ones would carry run's steps)
    fresh = dpltm.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                               batch_size=30).save(tmp_path / "fresh.pt")
    assert "nothing spent" in cli("inspect", str(fresh)).stdout
