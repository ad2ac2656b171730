"""Curves of finished runs (what `dpltm plot` draws), read from each run folder's `run.json`.

A train run gets two panels: accuracy vs epoch (test solid, validation dashed) and the ε spent
so far by the DP part vs epoch. A generate run gets one panel: ticket accuracy vs the fraction
of weights left, on a log axis running from dense (left) to sparse (right), as in the
lottery-ticket papers (Frankle & Carbin 2019). Legends never suggest a guarantee that does not
hold: a non-private run says "non-private" and has no ε curve, and a run whose report says it is
not DP end to end says so, since its ε axis covers only the DP part.

matplotlib is an optional extra (`dpltm[plots]`), imported only here and only when drawing.
Figures are built on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot, so the
user's global backend and pyplot state are left alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.errors import DpltmUserError

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RUN_FILE = "run.json"
RUN_FORMAT = "dpltm-run-v1"
PLOT_FILE = "plot.png"
COMMANDS = ("train", "generate")
_RECORDS = {"train": ("history", "epoch"), "generate": ("tickets", "density")}
"""Per command: the list of records that holds its curve, and the key every record must have."""
_METRICS = ("val_accuracy", "test_accuracy", "epsilon", "epsilon_dp_part")
KIND_STYLES = {"imp": "-", "random-reinit": "--", "random-mask": ":"}
"""Line style per ticket kind: the lottery tickets solid, the two controls broken."""
NOT_E2E = " — not DP end to end"
NON_PRIVATE = " (non-private)"


# -- reading -------------------------------------------------------------------------------------


def run_file(path: Path) -> Path:
    """A run is named by its folder or by its run.json; both mean the same file."""
    return path / RUN_FILE if path.is_dir() else path


def read_run(path: Path) -> PlotRun:
    """The run record at `path` (a run folder or its run.json), checked well enough that drawing
    it cannot fail half way: every mistake is one `DpltmUserError` line naming the file."""
    file = run_file(path)
    if not file.exists():
        where = f"no {RUN_FILE} in {path}" if path.is_dir() else f"{path} does not exist"
        raise DpltmUserError(f"{where} (a run writes it when it finishes)")
    from dpltm.paths import check_input_file

    check_input_file(file, "run record")
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DpltmUserError(f"{file} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise DpltmUserError(f"{file} is nested too deeply to be a dpltm run record") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DpltmUserError(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(body, dict):
        raise DpltmUserError(f"{file} is not a dpltm run record (a JSON {type(body).__name__}, not an object)")
    if body.get("format") != RUN_FORMAT:
        found = f"format {body['format']!r}" if "format" in body else "no format"
        raise DpltmUserError(f"{file} is not a dpltm run record ({found}, expected {RUN_FORMAT!r})")
    command = body.get("command")
    if command not in COMMANDS:
        what = f"a {command!r} run" if isinstance(command, str) else "no command"
        raise DpltmUserError(f"{file} records {what}; dpltm plot draws {' and '.join(COMMANDS)} runs")
    field = _RECORDS[command][0]
    status = body.get("status")
    if field not in body and status in ("running", "interrupted", "failed"):  # say why there is no curve
        said = {"running": "is still running, or was killed before it could say so",
                "interrupted": "was interrupted", "failed": "failed"}[status]
        raise DpltmUserError(f"{file}: the {command} run {said} before it recorded any {field}: nothing to draw")
    return PlotRun.from_body(body, file)


def _check_records(body: Mapping[str, Any], command: str, file: Path) -> None:
    """The curve's records: a list of objects, each with its x value, metrics numbers or null."""
    field, x_key = _RECORDS[command]
    records = body.get(field)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DpltmUserError(f"{file}: a {command} run needs a '{field}' list of records")
    for i, record in enumerate(records):
        x = _number(record.get(x_key))
        if x is None or not math.isfinite(x) or (command == "generate" and x <= 0):
            raise DpltmUserError(f"{file}: {field}[{i}] has no valid {x_key!r} ({record.get(x_key)!r})")
        for key in _METRICS:
            if key in record and record[key] is not None and _number(record[key]) is None:
                raise DpltmUserError(f"{file}: {field}[{i}].{key} is not a number ({record[key]!r})")
            value = _number(record.get(key))
            if value is not None and not math.isnan(value) and not _in_range(key, value):
                raise DpltmUserError(f"{file}: {field}[{i}].{key} = {record[key]!r} is out of range "
                                     f"({'[0, 1]' if 'accuracy' in key else '≥ 0'})")
    report = body.get("report")
    if report is not None and not isinstance(report, dict):
        raise DpltmUserError(f"{file}: 'report' is not an object")


def _in_range(key: str, value: float) -> bool:
    """Accuracies lie in [0, 1]; an ε is ≥ 0 (∞ allowed: a run that is not DP end to end)."""
    return 0.0 <= value <= 1.0 if "accuracy" in key else value >= 0.0


def _number(value: Any) -> float | None:
    """A JSON number, or one of the strings JSON uses for what it cannot spell ("inf"); None
    for null or anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


#: What a run's history calls ε: `epsilon` for a run that is DP end to end, `epsilon_dp_part`
#: otherwise (dpltm.run_log never lets a bare "epsilon" stand for a run that is not).
EPSILON_KEYS = ("epsilon", "epsilon_dp_part")


@dataclass(frozen=True)
class Point:
    """One record of a run's curve: an epoch of a train run (`x` its number) or a ticket of a generate run
    (`x` its density); None where the record has no number."""

    x: float
    val_accuracy: float | None
    test_accuracy: float | None
    epsilon: float | None = None
    kind: str = "imp"


@dataclass(frozen=True)
class PlotRun:
    """What `dpltm plot` draws of one run.json: its command and status, its curve, and the privacy facts its
    legend must not overstate (`private`: the report's word, else whether any ε was recorded;
    `end_to_end_dp`: the report's, or the run's own; `dp_part`: its history names ε `epsilon_dp_part`)."""

    command: str
    points: tuple[Point, ...]
    status: str | None = None
    private: bool = False
    end_to_end_dp: bool | None = None
    dp_part: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any], file: Path) -> PlotRun:
        """A run.json's body (its format and command already checked), its records checked."""
        command = body["command"]
        _check_records(body, command, file)
        records, x_key = body[_RECORDS[command][0]], _RECORDS[command][1]
        eps_key = next((k for k in EPSILON_KEYS if any(k in r for r in records)), EPSILON_KEYS[0])
        points = tuple(Point(float(_number(r[x_key])), _number(r.get("val_accuracy")),  # type: ignore[arg-type]
                             _number(r.get("test_accuracy")), _number(r.get(eps_key)), str(r.get("kind") or "imp"))
                       for r in records)
        report = body.get("report") or {}
        history = body.get("history", [])
        private = report["private"] if isinstance(report.get("private"), bool) else any(
            _number(r.get(key)) is not None for r in history for key in EPSILON_KEYS)
        return cls(command, points, body.get("status"), private, report.get("end_to_end_dp", body.get("end_to_end_dp")),
                   any("epsilon_dp_part" in r for r in history))


def _series(values: Sequence[float | None]) -> list[float]:
    """One metric across records, NaN where missing or infinite so that matplotlib leaves a gap
    (an infinite point would wreck the axis limits)."""
    return [v if v is not None and math.isfinite(v) else math.nan for v in values]


# -- labels --------------------------------------------------------------------------------------


def run_label(folder: Path) -> str:
    """`train/mnist/version_3`: the part of a run folder that tells runs apart."""
    return "/".join(folder.resolve().parts[-3:])


def qualified_label(run: PlotRun, label: str) -> str:
    """The legend label with the caveats a reader must not miss."""
    if run.command == "train" and not run.private:
        return label + NON_PRIVATE  # already says there is no guarantee; "not DP end to end" would repeat it
    if run.end_to_end_dp is False:
        label += NOT_E2E
    if run.status in ("running", "failed", "interrupted"):
        label += f" ({run.status})"
    return label


# -- drawing -------------------------------------------------------------------------------------


def _matplotlib() -> tuple[type, type]:
    """`Figure` and `FigureCanvasAgg`, imported only when a plot is drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DpltmUserError("dpltm plot needs matplotlib: pip install 'dpltm[plots]'") from None
    return Figure, FigureCanvasAgg


def run_figure(runs: list[PlotRun], labels: list[str]) -> Figure:
    """The figure for runs of one command, each labelled (plus its caveats) in the legend.
    Pure: builds the figure, saves nothing."""
    if len(runs) != len(labels):
        raise ValueError(f"{len(runs)} runs but {len(labels)} labels")
    if not runs:
        raise DpltmUserError("dpltm plot needs at least one run")
    commands = sorted({run.command for run in runs})
    if len(commands) > 1:
        raise DpltmUserError(f"cannot plot {' and '.join(map(str, commands))} runs together: plot them separately")
    figure_cls, canvas_cls = _matplotlib()
    labels = [qualified_label(run, label) for run, label in zip(runs, labels)]
    if commands[0] == "train":
        fig = figure_cls(figsize=(11, 4.2), layout="constrained")
        acc_ax, eps_ax = fig.subplots(1, 2)
        _draw_training(acc_ax, eps_ax, runs, labels)
    elif commands[0] == "generate":
        fig = figure_cls(figsize=(6.5, 4.2), layout="constrained")
        _draw_tickets(fig.subplots(), runs, labels)
    else:
        raise DpltmUserError(f"dpltm plot draws {' and '.join(COMMANDS)} runs, not {commands[0]!r}")
    canvas_cls(fig)  # attaches itself as fig.canvas: drawing never goes through pyplot's backend
    return fig


def _draw_training(acc_ax: Axes, eps_ax: Axes, runs: list[PlotRun], labels: list[str]) -> None:
    """Accuracy per epoch (test solid, validation dashed) and the DP part's ε per epoch; one
    colour per run across both panels."""
    from matplotlib.ticker import MaxNLocator

    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = f"C{i % 10}"
        epochs = [p.x for p in run.points]
        for values, style, name in (([p.test_accuracy for p in run.points], "-", "test"),
                                    ([p.val_accuracy for p in run.points], "--", "validation")):
            if any(not math.isnan(v) for v in _series(values)):
                acc_ax.plot(epochs, _series(values), style, color=colour, marker=".", label=f"{label}: {name}")
        if run.private:
            eps_ax.plot(epochs, _series([p.epsilon for p in run.points]), "-", color=colour, marker=".", label=label)
    acc_ax.set(title="accuracy (solid: test, dashed: validation)", xlabel="epoch", ylabel="accuracy")
    partial = any(run.dp_part for run in runs if run.private)
    eps_ax.set(title="privacy spent", xlabel="epoch", ylabel="ε (DP part)" if partial else "ε")
    for ax in (acc_ax, eps_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        _legend_below(ax)
    if not eps_ax.get_lines():
        eps_ax.text(0.5, 0.5, "non-private runs only:\nno privacy guarantee, no ε to plot",
                    ha="center", va="center", transform=eps_ax.transAxes)


def ticket_metric(tickets: Sequence[Point]) -> str:
    """Test accuracy when every ticket has one, else validation: one run's lines never mix the
    two, so its points stay comparable."""
    has_test = bool(tickets) and all(t.test_accuracy is not None for t in tickets)
    return "test_accuracy" if has_test else "val_accuracy"


def tickets_by_kind(tickets: Sequence[Point]) -> dict[str, list[Point]]:
    """Tickets grouped by kind (first-seen order), each group from dense to sparse."""
    groups: dict[str, list[Point]] = {}
    for ticket in tickets:
        groups.setdefault(ticket.kind, []).append(ticket)
    return {kind: sorted(group, key=lambda t: -t.x) for kind, group in groups.items()}


def _draw_tickets(ax: Axes, runs: list[PlotRun], labels: list[str]) -> None:
    """Accuracy vs density, one line per ticket kind per run, log x from dense to sparse."""
    metrics = set()
    for i, (run, label) in enumerate(zip(runs, labels)):
        metric = ticket_metric(run.points)
        metrics.add(metric)
        for kind, group in tickets_by_kind(run.points).items():
            ax.plot(_series([t.x for t in group]), _series([getattr(t, metric) for t in group]),
                    KIND_STYLES.get(kind, "-."), color=f"C{i % 10}", marker="o",
                    label=f"{label}: {kind} ({metric.split('_')[0]})")
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.xaxis.set_major_formatter(_fraction_formatter())
    ax.xaxis.set_minor_formatter(_fraction_formatter())
    ylabel = {"test_accuracy": "test accuracy", "val_accuracy": "validation accuracy"}
    ax.set(title="tickets", xlabel="fraction of weights left (log scale)",
           ylabel=ylabel[metrics.pop()] if len(metrics) == 1 else "accuracy (test or validation: see legend)")
    ax.grid(alpha=0.3, which="both")
    _legend_below(ax)


def _fraction_formatter() -> Any:
    """Log-axis ticks written as fractions (0.5, 0.01), not 5×10⁻¹ or 1e-02; matplotlib still
    decides which ticks get a label, so several decades stay readable."""
    from matplotlib.ticker import LogFormatter

    class FractionFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return FractionFormatter(labelOnlyBase=False)


def _legend_below(ax: Axes) -> None:
    """Labels carry caveats and run folders, so they are long: below the panel, not over the curves."""
    if ax.get_lines():
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)


# -- writing -------------------------------------------------------------------------------------


def plot_format(out: Path) -> str:
    """The image format named by the output's suffix: a `.pdf` file must not hold PNG bytes."""
    fmt = out.suffix.lower().lstrip(".")
    _, canvas_cls = _matplotlib()
    supported = {"png", "pdf", "svg"} & set(canvas_cls.get_supported_filetypes())
    if fmt not in supported:
        raise DpltmUserError(f"cannot tell the image format of {out}: name it *.{' or *.'.join(sorted(supported))}")
    return fmt


def plot_runs(paths: list[Path], out: Path | None = None, overwrite: bool = False) -> Path:
    """Read the runs, draw them, and write the image atomically; returns the path written.
    Default output: `plot.png` in the first run's folder (redrawn each time: it is derived); an
    explicit `out` that exists is replaced only with `overwrite`."""
    from dpltm.outputs import check_writable, same_file, write_atomic
    from dpltm.paths import check_path_length

    if not paths:
        raise DpltmUserError("dpltm plot needs at least one run")
    runs = [read_run(p) for p in paths]
    folders = [run_file(p).parent for p in paths]
    if out is not None:
        check_path_length(out, "--out")
    if out is not None and out.is_file() and not overwrite:
        raise DpltmUserError(f"{out} exists: pass --overwrite to replace it")
    out = out if out is not None else folders[0] / PLOT_FILE
    if any(same_file(out, run_file(p)) for p in paths):
        raise DpltmUserError(f"--out {out} is also this command's input: write the figure elsewhere")
    check_writable(out)  # before drawing: fail fast on a directory or a read-only place
    fmt = plot_format(out)
    try:
        fig = run_figure(runs, [run_label(f) for f in folders])
        write_atomic(out, lambda handle: fig.savefig(handle, format=fmt, dpi=120))
    except OSError as exc:
        raise DpltmUserError(f"cannot write {out}: {exc.strerror or exc}") from None
    except (ValueError, OverflowError) as exc:  # matplotlib on values it cannot lay out (finite but ~1e308)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"cannot draw these runs ({reason}): a value in a run file is out of any plottable "
                             "range") from None
    return out
