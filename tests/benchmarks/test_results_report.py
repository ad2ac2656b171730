"""The reproduction's report flags same-data runs as NOT end-to-end DP in legends and headers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from grid import report as results_report
from grid.report import NOT_DP_FLAG, make_figures, summarise, write_markdown

EPSILONS = [1.0, 0.2]


def _rows() -> list[dict[str, str]]:
    rows = []
    for method, eps_list, e2e in (("dpltm-same", ["1", "0.2"], "False"), ("random-ticket", ["0.2"], "False"),
                                  ("dpltm-public", ["1", "0.2"], "True"), ("dpsgd", ["1", "0.2"], "True"),
                                  ("nonprivate", ["inf"], "False")):
        for eps in eps_list:
            for seed, acc in (("0", "0.8"), ("1", "0.82")):
                rows.append({"dataset": "mnist", "method": method, "epsilon_target": eps, "seed": seed,
                             "test_accuracy": acc, "epsilon": eps, "end_to_end_dp": e2e, "seconds": "1.0"})
    return rows


def _curves() -> list[dict[str, str]]:
    return [{"dataset": "mnist", "method": method, "epsilon_target": "1", "seed": "0", "epoch": str(epoch),
             "test_accuracy": "0.5", "epsilon": str(0.2 * epoch)}
            for method in ("dpltm-same", "dpltm-public", "dpsgd") for epoch in (1, 2, 3)]


def test_markdown_flags_same_data_rows_and_table2_columns(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    write_markdown(summarise(_rows()), EPSILONS, 0.2, [], doc, "# header")
    lines = doc.read_text().splitlines()
    same_rows = [line for line in lines if line.startswith("| DPLTM same-data")]
    assert same_rows and all(NOT_DP_FLAG in line for line in same_rows)
    public_rows = [line for line in lines if line.startswith("| DPLTM public")]
    assert public_rows and all(NOT_DP_FLAG not in line for line in public_rows)
    header = next(line for line in lines if line.startswith("| dataset |") and "winner" in line)
    cells = [c.strip() for c in header.strip("|").split("|")]
    flagged = {c for c in cells if NOT_DP_FLAG in c}
    assert {c.split(" (")[0] for c in flagged} == {"DPLTM winner", "random ticket", "paper's DPLTM"}
    assert not any(NOT_DP_FLAG in c for c in cells if c.startswith(("DPLTM public", "DP-SGD")))


def test_figure_legends_flag_same_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    legends: list[list[str]] = []
    original = Figure.savefig

    def record(self: Figure, *args: Any, **kwargs: Any) -> None:
        legend = self.axes[0].get_legend()
        legends.append([text.get_text() for text in legend.get_texts()])
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    paths = make_figures(summarise(_rows()), _curves(), EPSILONS, 1.0, tmp_path)
    assert len(legends) == 2 and all(p.stat().st_size > 0 for p in paths)
    for labels in legends:
        same = [label for label in labels if label.startswith("DPLTM same-data")]
        assert same and all(NOT_DP_FLAG in label for label in same)
        assert not any(NOT_DP_FLAG in label for label in labels if label.startswith("DPLTM public"))
    assert all(NOT_DP_FLAG in results_report.LEGEND_LABELS[m] for m in results_report.NOT_END_TO_END)
