"""`--search` on `select --noise-aware` and `run` (issue 21, item 3): the choice records the variant it chose
(start, frozen layers, release), `train` runs the winner so unless the config file or flags say otherwise (and
says which), a setting the user gives fixes its dimension, and none of it touches the private ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpltm.checkpoint import load_checkpoint, save_atomic
from dpltm.privacy.ledger import PrivacyLedger
from tests.datafiles import write_mnist

FAST_GEN = ["--rounds", "2", "--iterations", "15", "--batch-size", "16", "--device", "cpu", "--no-progress"]
FAST_TRAIN = ["--epochs", "2", "--batch-size", "16", "--eps2", "1", "--device", "cpu", "--no-progress", "--json"]
PLANNED = ["--noise-aware", "--private-size", "120", "--eps2", "1", "--epochs", "2", "--batch-size", "16",
           "--device", "cpu", "--seed", "0", "--no-progress"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_mnist(root, "MNIST", n_train=120, n_test=30)
    write_mnist(root, "FashionMNIST", n_train=120, n_test=30)
    return root


@pytest.fixture(scope="module")
def tickets(data_root: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("public") / "t.pt"
    cli("generate", "--dataset", "mnist", "--data-dir", str(data_root), *FAST_GEN, "--out", str(path))
    return path


def _select(cli, data_root: Path, tickets: Path, out: Path, *extra: str, ok: bool = True) -> Any:  # type: ignore[no-untyped-def]
    return cli("select", "--tickets", str(tickets), *PLANNED, "--data-dir", str(data_root), "--out", str(out),
               *extra, ok=ok)


def _train(cli, data_root: Path, winner: Path, out: Path, *extra: str) -> Any:  # type: ignore[no-untyped-def]
    return cli("train", "--ticket", str(winner), "--dataset", "fashion-mnist", "--data-dir", str(data_root),
               "--out", str(out), "--seed", "1", *FAST_TRAIN, *extra)


def test_select_searches_starts_and_releases_and_records_the_variant(  # type: ignore[no-untyped-def]
        data_root: Path, tickets: Path, tmp_path: Path, cli) -> None:
    result = _select(cli, data_root, tickets, tmp_path / "w.pt", "--search", "start,release")
    choice = load_checkpoint(tmp_path / "w.pt", "ticket")["selection"]["noise_aware"]
    assert choice["searched"] == ["start", "release"]
    assert len(choice["candidates"]) == 3 * 2 * 2  # 3 tickets × 2 starts × 2 releases
    assert set(choice["chosen"]) == {"start", "freeze", "ema", "ema_warmup", "output_layer"}
    shown = " ".join(result.stderr.split())
    assert "variants (start, release)" in shown and "chosen variant:" in shown
    plain = _select(cli, data_root, tickets, tmp_path / "p.pt", "--search", "none")
    record = load_checkpoint(tmp_path / "p.pt", "ticket")["selection"]["noise_aware"]
    assert record["searched"] == [] and record["chosen"] is None and len(record["candidates"]) == 3
    assert "variants" not in plain.stderr


def test_train_runs_the_chosen_variant_unless_told_otherwise(  # type: ignore[no-untyped-def]
        data_root: Path, tickets: Path, tmp_path: Path, cli) -> None:
    _select(cli, data_root, tickets, tmp_path / "w.pt", "--search", "start,release")
    body = load_checkpoint(tmp_path / "w.pt", "ticket")
    # whatever the tiny proxy picked, make the record name a public start and a warmed-up EMA
    body["selection"]["noise_aware"]["chosen"] = {"start": "public", "freeze": [], "ema": 0.9, "ema_warmup": True,
                                                  "output_layer": "reinit"}
    body = {k: v for k, v in body.items() if k not in ("format", "kind", "format_version", "environment")}
    save_atomic(body, tmp_path / "w2.pt", "ticket")
    chosen = _train(cli, data_root, tmp_path / "w2.pt", tmp_path / "m.pt")
    report = json.loads(chosen.stdout)
    assert report["transfer"]["rewind"] == "public" and report["released_weights"] == "ema(0.9, warm-up)"
    assert "the noise-aware choice chose: start from its public-trained weights" in " ".join(chosen.stderr.split())
    assert "override" not in chosen.stderr
    told = _train(cli, data_root, tmp_path / "w2.pt", tmp_path / "o.pt", "--rewind", "init", "--ema", "0.99")
    report = json.loads(told.stdout)
    # a setting given fixes its whole dimension: --ema 0.99 takes the release (no warm-up), not half of it
    assert report["transfer"]["rewind"] == "init" and report["released_weights"] == "ema(0.99)"
    assert "override it: start from θ0" in " ".join(told.stderr.split())
    # the choice ran on public data only, and whichever variant runs, the private ledger is the same
    ledgers = [load_checkpoint(model, "model")["privacy"]["ledger"] for model in (tmp_path / "m.pt", tmp_path / "o.pt")]
    assert ledgers[0] == ledgers[1]
    ledger = PrivacyLedger.from_json(ledgers[0])
    assert ledger.selection_eps1 is None and type(ledger.selection_event()).__name__ == "NoOpDpEvent"


def test_a_setting_the_user_gives_fixes_its_dimension(  # type: ignore[no-untyped-def]
        data_root: Path, tickets: Path, tmp_path: Path, cli) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  ema: 0.95\n")
    result = _select(cli, data_root, tickets, tmp_path / "w.pt", "--search", "start,release", "--config", str(config))
    choice = load_checkpoint(tmp_path / "w.pt", "ticket")["selection"]["noise_aware"]
    assert choice["searched"] == ["start"] and {c["ema"] for c in choice["candidates"]} == {0.95}
    assert "--search release: not searched, the ema setting given fixes it" in " ".join(result.stderr.split())


def test_run_searches_start_and_release_by_default_and_a_flag_fixes_one(  # type: ignore[no-untyped-def]
        data_root: Path, tmp_path: Path, cli) -> None:
    common = ["run", "--dataset", "fashion-mnist", "--public-dataset", "mnist", "--public-split", "train",
              "--data-dir", str(data_root), "--rounds", "1", "--iterations", "10", "--epochs", "1", "--batch-size",
              "16", "--device", "cpu", "--no-progress", "--json"]
    cli(*common, "--out", str(tmp_path / "a.pt"))
    record = load_checkpoint(tmp_path / "a-winner.pt", "ticket")["selection"]["noise_aware"]
    assert record["searched"] == ["start", "release"] and record["chosen"] is not None
    trained = load_checkpoint(tmp_path / "a.pt", "model")["config"]["train"]
    assert trained["rewind"] == record["chosen"]["start"] and trained["ema"] == record["chosen"]["ema"]
    cli(*common, "--rewind", "init", "--out", str(tmp_path / "b.pt"))
    record = load_checkpoint(tmp_path / "b-winner.pt", "ticket")["selection"]["noise_aware"]
    assert record["searched"] == ["release"] and {c["start"] for c in record["candidates"]} == {"init"}
    cli(*common, "--choice", "best", "--out", str(tmp_path / "c.pt"))  # no choice to widen: no search, no error


def test_a_chosen_variant_never_moves_training_onto_the_tickets_data(  # type: ignore[no-untyped-def]
        data_root: Path, tmp_path: Path, cli) -> None:
    """Tickets made on Fashion-MNIST, a search, then `train --ticket W` without --dataset: training runs on the
    default private dataset (MNIST), end-to-end DP — the ticket's own data is taken only for a private ticket."""
    cli("generate", "--dataset", "fashion-mnist", "--data-dir", str(data_root), *FAST_GEN, "--out",
        str(tmp_path / "t.pt"))
    _select(cli, data_root, tmp_path / "t.pt", tmp_path / "w.pt", "--search", "start,release")
    report = json.loads(cli("train", "--ticket", str(tmp_path / "w.pt"), "--data-dir", str(data_root), "--out",
                            str(tmp_path / "m.pt"), *FAST_TRAIN).stdout)
    assert report["dataset"] == "mnist" and report["end_to_end_dp"] is True


def test_a_dimension_not_searched_leaves_the_recipe_alone(  # type: ignore[no-untyped-def]
        data_root: Path, tickets: Path, tmp_path: Path, cli) -> None:
    _select(cli, data_root, tickets, tmp_path / "w.pt", "--search", "start")
    report = _train(cli, data_root, tmp_path / "w.pt", tmp_path / "m.pt", "--recipe", "tuned")
    assert json.loads(report.stdout)["released_weights"] == "ema(0.999)"  # the tuned recipe's, not the plan's


def test_a_chosen_frozen_layer_where_freezing_cannot_run_is_one_line(  # type: ignore[no-untyped-def]
        data_root: Path, tickets: Path, tmp_path: Path, cli) -> None:
    _select(cli, data_root, tickets, tmp_path / "w.pt", "--search", "start,freeze")
    body = load_checkpoint(tmp_path / "w.pt", "ticket")
    body["selection"]["noise_aware"]["chosen"] = {"start": "public", "freeze": ["hidden.0"], "ema": None,
                                                  "ema_warmup": False, "output_layer": "reinit"}
    body = {k: v for k, v in body.items() if k not in ("format", "kind", "format_version", "environment")}
    save_atomic(body, tmp_path / "f.pt", "ticket")
    result = cli("train", "--ticket", str(tmp_path / "f.pt"), "--dataset", "fashion-mnist", "--data-dir",
                 str(data_root), "--out", str(tmp_path / "m.pt"), *FAST_TRAIN, "--noise", "dpd", ok=False)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "holds hidden.0 at its public weights" in " ".join(result.stderr.split())
    assert not (tmp_path / "m.pt").exists()
