"""Aggregate a reproduction's CSVs into tables, figures and docs/results.md.

Runs whose tickets were made on the private training data (`dpltm-same`, `random-ticket`) are
not end-to-end DP (docs/privacy.md §1): every label that names them, in the figures' legends and in
the tables' headers, says so (`NOT_DP_FLAG`).
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

PAPER_TABLE2 = {"mnist": 0.84, "har": 0.61, "fashion-mnist": 0.77, "kmnist": 0.60, "isolet": 0.58}
"""DPLTM test accuracy at ε = 0.2 in the paper's Table 2 (same-data mode)."""
NOT_DP_FLAG = "NOT end-to-end DP"
NOT_END_TO_END = frozenset({"dpltm-same", "random-ticket"})
"""Methods whose tickets come from non-private training on the private data."""
METHOD_LABELS = {
    "dpltm-noise-aware": "DPLTM public tickets, noise-aware choice (end-to-end DP)",
    "dpltm-private": "DPLTM private tickets (DP warm-up; end-to-end DP)",
    "dpltm-same": f"DPLTM same-data (paper's mode; {NOT_DP_FLAG})",
    "dpltm-public": "DPLTM public tickets (end-to-end DP)",
    "dpsgd": "dense DP-SGD",
    "dpsgd-public": "dense DP-SGD from the public weights (fine-tuning; end-to-end DP)",
    "dpsgd-rewind": "dense DP-SGD from θ_K, iterate K of public training (end-to-end DP)",
    "nonprivate": "non-private",
    "random-ticket": f"random same-data ticket ({NOT_DP_FLAG})",
    "random-mask": "random mask at the winner's density (control; end-to-end DP)",
}
LEGEND_LABELS = {
    "dpltm-noise-aware": "DPLTM noise-aware public (DP)",
    "dpltm-private": "DPLTM private tickets (DP)",
    "dpltm-same": f"DPLTM same-data ({NOT_DP_FLAG})",
    "dpltm-public": "DPLTM public tickets (end-to-end DP)",
    "dpsgd": "dense DP-SGD",
    "dpsgd-public": "dense DP-SGD, public start",
    "dpsgd-rewind": "dense DP-SGD, θ_K start",
    "nonprivate": "non-private",
    "random-ticket": f"random same-data ticket ({NOT_DP_FLAG})",
    "random-mask": "random mask (control, DP)",
}
"""Shorter labels for the figures' legends; the flag stays."""
METHOD_ORDER = ("dpltm-noise-aware", "dpltm-private", "dpltm-public", "random-mask", "dpsgd", "dpsgd-public",
                "dpsgd-rewind", "dpltm-same")
"""Rows and curves, sound modes first; only the methods a grid ran are shown."""
SOUND_METHODS = ("dpltm-noise-aware", "dpltm-private", "dpltm-public")
COLOURS = {"dpltm-noise-aware": "tab:orange", "dpltm-private": "tab:brown", "dpltm-same": "tab:red",
           "dpltm-public": "tab:purple", "dpsgd": "tab:blue", "dpsgd-public": "tab:cyan", "dpsgd-rewind": "tab:olive",
           "nonprivate": "tab:green",
           "random-mask": "tab:gray"}
TABLE2_HEADER = (f"| dataset | DPLTM winner (same-data; {NOT_DP_FLAG}) | random ticket (same-data; {NOT_DP_FLAG}) "
                 "| DPLTM public tickets (end-to-end DP) | DPLTM private tickets (end-to-end DP) | DP-SGD "
                 f"| paper's DPLTM (same-data; {NOT_DP_FLAG}) |")


def read_rows(out_dir: Path, prefix: str) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted(out_dir.glob(f"{prefix}-*.csv")):
        with path.open() as handle:
            rows.extend(csv.DictReader(handle))
    return rows


def summarise(rows: list[dict[str, str]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["method"], r["epsilon_target"])].append(r)
    out = {}
    for key, members in groups.items():
        acc = np.array([float(m["test_accuracy"]) for m in members])
        eps = [float(m["epsilon"]) if m["epsilon"] not in ("inf", "") else math.inf for m in members]
        out[key] = {"mean": float(acc.mean()), "std": float(acc.std(ddof=1)) if acc.size > 1 else 0.0,
                    "n": int(acc.size), "epsilon": max(eps),
                    "end_to_end": all(m["end_to_end_dp"] == "True" for m in members),
                    "seconds": float(np.mean([float(m["seconds"]) for m in members]))}
    return out


def _cell(stats: dict[str, Any] | None, seeds: int | None = None) -> str:
    """mean ± std over seeds; the number of seeds when it is fewer than the grid's (`seeds`)."""
    if stats is None:
        return "–"
    text = f"{stats['mean']:.3f} ± {stats['std']:.3f}" if stats["n"] > 1 else f"{stats['mean']:.3f}"
    return text + (f" (n={stats['n']})" if seeds is not None and stats["n"] < seeds else "")


def make_figures(summary: dict[tuple[str, str, str], dict[str, Any]], curves: list[dict[str, str]],
                 epsilons: list[float], curve_eps: float, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({k[0] for k in summary})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    colours = COLOURS
    methods = [m for m in METHOD_ORDER if any(k[1] == m for k in summary)]
    for ax, dataset in zip(axes[0], datasets):
        xs = [f"{e:g}" for e in epsilons]
        for method in methods:
            stats = [summary.get((dataset, method, x)) for x in xs]
            if not any(stats):
                continue
            means = [s["mean"] if s else np.nan for s in stats]
            stds = [s["std"] if s else 0.0 for s in stats]
            ax.errorbar(range(len(xs)), means, yerr=stds, marker="o", capsize=3, color=colours[method],
                        label=LEGEND_LABELS[method])
        np_stats = summary.get((dataset, "nonprivate", "inf"))
        if np_stats:
            ax.axhline(np_stats["mean"], color=colours["nonprivate"], linestyle="--",
                       label=LEGEND_LABELS["nonprivate"])
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel("ε")
        ax.set_ylabel("test accuracy")
        ax.set_title(dataset)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Accuracy against ε (δ = 1e-5): DPLTM vs DP-SGD (cf. paper Fig. 1)")
    fig.tight_layout()
    fig1 = out_dir / "fig1_accuracy_vs_eps.png"
    fig.savefig(fig1, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for method in methods:
            pts = [c for c in curves if c["dataset"] == dataset and c["method"] == method
                   and c["epsilon_target"] == f"{curve_eps:g}" and c["seed"] == "0"]
            if not pts:
                continue
            pts.sort(key=lambda c: int(c["epoch"]))
            ax.plot([int(c["epoch"]) for c in pts], [float(c["test_accuracy"]) for c in pts],
                    color=colours[method], label=LEGEND_LABELS[method])
            for c in pts:
                if float(c["epsilon"]) >= 0.3 * curve_eps / 1.0:
                    ax.plot(int(c["epoch"]), float(c["test_accuracy"]), "k.", markersize=6)
                    break
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{dataset} (ε = {curve_eps:g}; • where ε spent ≥ {0.3 * curve_eps:g})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig2 = out_dir / "fig2_convergence.png"
    fig.savefig(fig2, dpi=120)
    plt.close(fig)
    return [fig1, fig2]


def write_markdown(summary: dict[tuple[str, str, str], dict[str, Any]], epsilons: list[float], random_eps: float,
                   figures: list[Path], doc: Path, header: str) -> None:
    datasets = sorted({k[0] for k in summary})
    xs = [f"{e:g}" for e in epsilons]
    methods = [m for m in METHOD_ORDER if any(k[1] == m for k in summary)]
    seeds = max((v["n"] for v in summary.values()), default=0)
    lines = [header, "", f"## Test accuracy against ε (mean ± std over {seeds} seeds unless n says fewer; "
             "δ = 1e-5)", ""]
    for dataset in datasets:
        lines += [f"### {dataset}", "", "| method | " + " | ".join(f"ε = {x}" for x in xs) + " |",
                  "| --- | " + " | ".join("---" for _ in xs) + " |"]
        for method in methods:
            lines.append(f"| {METHOD_LABELS[method]} | " + " | ".join(_cell(summary.get((dataset, method, x)), seeds)
                                                                     for x in xs) + " |")
        lines.append(f"| non-private | {_cell(summary.get((dataset, 'nonprivate', 'inf')), seeds)} |"
                     + " |" * (len(xs) - 1))
        lines.append("")
    lines += standing(summary, datasets, xs)
    lines += [f"## Winner against a random ticket at ε = {random_eps:g} (cf. paper Table 2)", "",
              TABLE2_HEADER,
              "| --- | --- | --- | --- | --- | --- | --- |"]
    r = f"{random_eps:g}"
    for dataset in datasets:
        paper = PAPER_TABLE2.get(dataset)
        public = summary.get((dataset, "dpltm-noise-aware", r)) or summary.get((dataset, "dpltm-public", r))
        lines.append(f"| {dataset} | {_cell(summary.get((dataset, 'dpltm-same', r)))} | "
                     f"{_cell(summary.get((dataset, 'random-ticket', r)))} | "
                     f"{_cell(public)} | "
                     f"{_cell(summary.get((dataset, 'dpltm-private', r)))} | "
                     f"{_cell(summary.get((dataset, 'dpsgd', r)))} | "
                     f"{paper if paper is not None else '–'} |")
    lines += ["", "## Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]
    doc.write_text("\n".join(lines) + "\n")


def standing(summary: dict[tuple[str, str, str], dict[str, Any]], datasets: list[str], xs: list[str]) -> list[str]:
    """Where each sound (end-to-end DP) DPLTM mode stands against dense DP-SGD, per dataset and ε:
    the difference of the mean test accuracies, in points, method by method (no best-of, which
    would favour DPLTM by selection). Where the grid also ran dense DP-SGD from the public weights,
    the dense side is the better of the two starts (the baseline a user would pick)."""
    short = {"dpltm-noise-aware": "noise-aware", "dpltm-private": "private", "dpltm-public": "public (score)"}
    lines = ["## The sound modes against dense DP-SGD (same recipe)", "",
             "Each end-to-end DP DPLTM mode minus dense DP-SGD (the best of its starts that "
             "ran: θ0, public weights, θ_K), in accuracy points (means over seeds; positive: DPLTM ahead).", "",
             "| dataset | " + " | ".join(f"ε = {x}" for x in xs) + " |",
             "| --- | " + " | ".join("---" for _ in xs) + " |"]
    for dataset in datasets:
        cells = []
        for x in xs:
            denses = [summary[key] for key in ((dataset, "dpsgd", x), (dataset, "dpsgd-public", x),
                                               (dataset, "dpsgd-rewind", x)) if key in summary]
            dense = max(denses, key=lambda row: row["mean"]) if denses else None
            parts = [f"{short[m]} {100 * (summary[(dataset, m, x)]['mean'] - dense['mean']):+.1f}"
                     for m in SOUND_METHODS if dense is not None and (dataset, m, x) in summary]
            cells.append("; ".join(parts) or "–")
        lines.append(f"| {dataset} | " + " | ".join(cells) + " |")
    return lines + [""]
