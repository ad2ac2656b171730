"""`dpltm plot`: the curves drawn are the run's records, and the legends never overstate privacy."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dpltm.errors import DpltmUserError
from dpltm.plotting import NON_PRIVATE, NOT_E2E, RUN_FILE, PlotRun, plot_runs, read_run, run_figure, run_label

matplotlib = pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(epochs: int, private: bool) -> list[dict[str, Any]]:
    return [{"epoch": e, "steps": 10 * e, "val_accuracy": 0.5 + 0.04 * e, "test_accuracy": 0.48 + 0.04 * e,
             "epsilon": 0.3 * e if private else None} for e in range(1, epochs + 1)]


def train_run(private: bool = True, end_to_end: bool = True, epochs: int = 4) -> dict[str, Any]:
    report = {"private": private, "end_to_end_dp": private and end_to_end,
              "epsilon": 1.2 if private and end_to_end else "inf", "epsilon_dp_part": 1.2 if private else None,
              "delta": 1e-5, "test_accuracy": 0.64, "statement": "line one\nline two", "released_weights": "final"}
    return {"format": "dpltm-run-v1", "command": "train", "dataset": "mnist", "output": "m.pt", "logger": "csv",
            "history": history(epochs, private), "report": report}


def generate_run() -> dict[str, Any]:
    tickets = [{"round": 0, "density": 1.0, "val_accuracy": 0.95, "test_accuracy": 0.94, "kind": "imp"}]
    for r, density in enumerate((0.7, 0.49, 0.343), start=1):
        tickets.append({"round": r, "density": density, "val_accuracy": 0.95 - 0.01 * r,
                        "test_accuracy": 0.94 - 0.01 * r, "kind": "imp"})
        tickets.append({"round": r, "density": density, "val_accuracy": 0.9 - 0.05 * r,
                        "test_accuracy": None, "kind": "random-reinit"})
    return {"format": "dpltm-run-v1", "command": "generate", "dataset": "mnist", "output": "t.pt",
            "logger": "csv", "tickets": tickets}


def figure(runs: list[dict[str, Any]], labels: list[str]) -> Any:
    """`run_figure` on run.json bodies, read as `read_run` reads them."""
    return run_figure([PlotRun.from_body(run, Path(RUN_FILE)) for run in runs], labels)


def write_run(root: Path, run: dict[str, Any], version: int) -> Path:
    """A run folder laid out as dpltm writes it: runs/<command>/<dataset>/version_<N>/run.json."""
    folder = root / "runs" / run["command"] / run["dataset"] / f"version_{version}"
    folder.mkdir(parents=True)
    (folder / RUN_FILE).write_text(json.dumps(run))
    return folder


def lines_by_label(ax: Any) -> dict[str, Any]:
    return {line.get_label(): line for line in ax.get_lines()}


def one_line_error(call: Any, match: str) -> str:
    with pytest.raises(DpltmUserError, match=match) as info:
        call()
    message = str(info.value)
    assert message and "\n" not in message
    return message


# -- train -----------------------------------------------------------------------------------------


def test_train_panels_hold_the_history_exactly() -> None:
    run = train_run()
    fig = figure([run], ["train/mnist/version_0"])
    acc_ax, eps_ax = fig.axes
    epochs = [r["epoch"] for r in run["history"]]
    acc = lines_by_label(acc_ax)
    test, val = acc["train/mnist/version_0: test"], acc["train/mnist/version_0: validation"]
    assert list(test.get_xdata()) == epochs and list(val.get_xdata()) == epochs
    assert list(test.get_ydata()) == [r["test_accuracy"] for r in run["history"]]
    assert list(val.get_ydata()) == [r["val_accuracy"] for r in run["history"]]
    assert test.get_linestyle() == "-" and val.get_linestyle() == "--"
    assert test.get_color() == val.get_color()
    (eps,) = eps_ax.get_lines()
    assert list(eps.get_xdata()) == epochs
    assert list(eps.get_ydata()) == [r["epsilon"] for r in run["history"]]
    assert eps.get_label() == "train/mnist/version_0"
    assert eps_ax.get_ylabel() == "ε" and eps_ax.get_xlabel() == "epoch"  # DP end to end: no "(DP part)"


def test_non_private_run_has_no_epsilon_line_and_says_so() -> None:
    private, public = train_run(epochs=3), train_run(private=False, epochs=5)
    fig = figure([private, public], ["train/mnist/version_1", "train/mnist/version_2"])
    acc_ax, eps_ax = fig.axes
    assert [line.get_label() for line in eps_ax.get_lines()] == ["train/mnist/version_1"]
    public_lines = [line for line in acc_ax.get_lines() if "version_2" in line.get_label()]
    assert len(public_lines) == 2
    assert all(line.get_label().startswith(f"train/mnist/version_2{NON_PRIVATE}:") for line in public_lines)
    assert all("non-private" in line.get_label() and NOT_E2E not in line.get_label() for line in public_lines)
    assert all("non-private" not in line.get_label() for line in acc_ax.get_lines() if "version_1" in line.get_label())
    assert [len(line.get_xdata()) for line in public_lines] == [5, 5]
    legend = [t.get_text() for t in acc_ax.get_legend().get_texts()]
    assert any("non-private" in t for t in legend)


def test_only_non_private_runs_leave_the_epsilon_panel_explained() -> None:
    fig = figure([train_run(private=False)], ["train/mnist/version_0"])
    eps_ax = fig.axes[1]
    assert not eps_ax.get_lines()
    assert any("no privacy guarantee" in t.get_text() for t in eps_ax.texts)


def test_not_end_to_end_dp_is_in_the_label() -> None:
    run = train_run(end_to_end=False)
    acc_ax, eps_ax = figure([run], ["train/mnist/version_7"]).axes
    for ax in (acc_ax, eps_ax):
        assert ax.get_lines()
        assert all(NOT_E2E in line.get_label() and "not DP end to end" in line.get_label() for line in ax.get_lines())
    (eps,) = eps_ax.get_lines()  # the DP part's ε is still drawn, as the finite value it is
    assert list(eps.get_ydata()) == [r["epsilon"] for r in run["history"]]
    labels = figure([train_run()], ["train/mnist/version_8"]).axes[0].get_lines()
    assert all("not DP" not in line.get_label() for line in labels)


def test_missing_metrics_are_gaps_not_zeros() -> None:
    run = train_run()
    run["history"][1]["test_accuracy"] = None
    del run["history"][2]["epsilon"]
    acc_ax, eps_ax = figure([run], ["r"]).axes
    test = lines_by_label(acc_ax)["r: test"].get_ydata()
    assert math.isnan(test[1]) and not math.isnan(test[0])
    assert math.isnan(eps_ax.get_lines()[0].get_ydata()[2])


# -- generate --------------------------------------------------------------------------------------


def test_generate_panel_log_inverted_and_points_equal_tickets() -> None:
    run = generate_run()
    fig = figure([run], ["generate/mnist/version_0"])
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.xaxis_inverted()
    lines = lines_by_label(ax)
    assert set(lines) == {"generate/mnist/version_0: imp (val)", "generate/mnist/version_0: random-reinit (val)"}
    for kind, line in (("imp", lines["generate/mnist/version_0: imp (val)"]),
                       ("random-reinit", lines["generate/mnist/version_0: random-reinit (val)"])):
        tickets = sorted((t for t in run["tickets"] if t["kind"] == kind), key=lambda t: -t["density"])
        assert list(line.get_xdata()) == [t["density"] for t in tickets]
        # a test accuracy is missing for some tickets: the whole run uses validation, never a mix
        assert list(line.get_ydata()) == [t["val_accuracy"] for t in tickets]
    assert ax.get_ylabel() == "validation accuracy"


def test_generate_uses_test_accuracy_when_every_ticket_has_one() -> None:
    run = generate_run()
    run["tickets"] = [t for t in run["tickets"] if t["kind"] == "imp"]
    (ax,) = figure([run], ["g"]).axes
    (line,) = ax.get_lines()
    assert line.get_label() == "g: imp (test)" and ax.get_ylabel() == "test accuracy"
    assert list(line.get_ydata()) == [t["test_accuracy"] for t in run["tickets"]]


# -- files and errors ------------------------------------------------------------------------------


def test_plot_runs_writes_a_png_beside_the_first_run(tmp_path: Path) -> None:
    first = write_run(tmp_path, train_run(), 0)
    second = write_run(tmp_path, train_run(private=False), 1)
    backend, rc = matplotlib.get_backend(), dict(matplotlib.rcParams)
    out = plot_runs([first, second / RUN_FILE])
    assert out == first / "plot.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert matplotlib.get_backend() == backend and dict(matplotlib.rcParams) == rc
    assert sorted(p.name for p in first.iterdir()) == ["plot.png", RUN_FILE]  # no temp file left


def test_plot_runs_to_a_new_folder_and_pdf(tmp_path: Path) -> None:
    run = write_run(tmp_path, generate_run(), 3)
    out = plot_runs([run], tmp_path / "new" / "deeper" / "tickets.png")
    assert out.read_bytes().startswith(PNG_MAGIC)
    pdf = plot_runs([run], tmp_path / "tickets.pdf")
    assert pdf.read_bytes().startswith(b"%PDF")


def test_labels_are_the_run_folders(tmp_path: Path) -> None:
    folder = write_run(tmp_path, train_run(), 3)
    out = plot_runs([folder], tmp_path / "p.png")
    assert out.exists()
    fig = run_figure([read_run(folder)], ["train/mnist/version_3"])
    assert run_label(folder) == "train/mnist/version_3"
    assert lines_by_label(fig.axes[1]).keys() == {"train/mnist/version_3"}


def test_read_run_errors_are_one_line(tmp_path: Path) -> None:
    one_line_error(lambda: read_run(tmp_path / "nowhere"), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(lambda: read_run(empty), "no run.json in")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / RUN_FILE).write_text("{not json\n\n")
    one_line_error(lambda: read_run(bad), "is not JSON")
    (bad / RUN_FILE).write_text(json.dumps({"format": "something-else", "command": "train"}))
    one_line_error(lambda: read_run(bad), "not a dpltm run record")
    (bad / RUN_FILE).write_text(json.dumps([1, 2]))
    one_line_error(lambda: read_run(bad), r"not a dpltm run record \(a JSON list, not an object\)")
    (bad / RUN_FILE).write_text(json.dumps({"command": "train"}))
    one_line_error(lambda: read_run(bad), r"not a dpltm run record \(no format")
    (bad / RUN_FILE).write_text(json.dumps({"format": "dpltm-run-v1"}))
    one_line_error(lambda: read_run(bad), "records no command; dpltm plot draws")
    (bad / RUN_FILE).write_text(json.dumps({"format": "dpltm-run-v1", "command": "select"}))
    one_line_error(lambda: read_run(bad), "'select' run")
    (bad / RUN_FILE).write_text(json.dumps({"format": "dpltm-run-v1", "command": "train"}))
    one_line_error(lambda: read_run(bad), "'history' list")
    broken = train_run()
    broken["history"][1]["val_accuracy"] = "high"
    (bad / RUN_FILE).write_text(json.dumps(broken))
    one_line_error(lambda: read_run(bad), r"history\[1\].val_accuracy")
    broken = generate_run()
    broken["tickets"][2]["density"] = 0
    (bad / RUN_FILE).write_text(json.dumps(broken))
    one_line_error(lambda: read_run(bad), r"tickets\[2\]")


def test_values_out_of_range_are_one_line_and_draw_nothing(tmp_path: Path) -> None:
    """Accuracies outside [0, 1] or a negative ε are refused when read; a finite value matplotlib cannot lay out
    (an epoch of 1e308) fails the drawing in one line, with no image written."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for key, value in (("val_accuracy", 1.5), ("val_accuracy", -0.1), ("epsilon", -5)):
        broken = train_run()
        broken["history"][0][key] = value
        (bad / RUN_FILE).write_text(json.dumps(broken))
        one_line_error(lambda: read_run(bad), rf"history\[0\].{key} = {value} is out of range")
    broken = train_run()
    broken["history"] = [{**broken["history"][0], "epoch": 1e308}]  # one point: its axis margins overflow
    (bad / RUN_FILE).write_text(json.dumps(broken))
    one_line_error(lambda: plot_runs([bad], tmp_path / "p.png"), "cannot draw these runs")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("status", ["running", "interrupted", "failed"])
def test_a_run_that_ended_before_its_records_says_so(status: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / RUN_FILE).write_text(json.dumps({"format": "dpltm-run-v1", "command": "generate", "status": status}))
    one_line_error(lambda: read_run(bad), "before it recorded any tickets: nothing to draw")


def test_report_epsilon_inf_string_is_read(tmp_path: Path) -> None:
    folder = write_run(tmp_path, train_run(end_to_end=False), 0)
    assert read_run(folder).end_to_end_dp is False


def test_mixed_commands_are_refused_in_one_line(tmp_path: Path) -> None:
    train, generate = write_run(tmp_path, train_run(), 0), write_run(tmp_path, generate_run(), 0)
    message = one_line_error(lambda: plot_runs([train, generate]), "cannot plot generate and train runs together")
    assert "separately" in message
    assert not (train / "plot.png").exists()


def test_bad_outputs_are_one_line(tmp_path: Path) -> None:
    folder = write_run(tmp_path, train_run(), 0)
    one_line_error(lambda: plot_runs([folder], tmp_path), "is a directory")
    one_line_error(lambda: plot_runs([folder], tmp_path / "plot.txt"), "image format")
    one_line_error(lambda: plot_runs([]), "at least one run")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            one_line_error(lambda: plot_runs([folder], locked / "p.png"), "not writable")
        finally:
            locked.chmod(0o700)


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    folder = write_run(tmp_path, train_run(), 0)
    message = one_line_error(lambda: plot_runs([folder]), "needs matplotlib")
    assert "pip install 'dpltm[plots]'" in message
