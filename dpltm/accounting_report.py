"""`dpltm account`: ε of DP-SGD by every accountant, side by side, or σ for a target ε."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import composition_bounds, epsilon, gdp_epsilon, gdp_mu
from dpltm.privacy.calibration import calibrate_noise_multiplier
from dpltm.privacy.events import dpsgd_event

SOUND = ("pld", "rdp")


def _mechanism(q: float | None, steps: int | None, dataset_size: int | None, batch_size: int | None,
               epochs: int | None) -> tuple[float, int]:
    if q is not None and steps is not None:
        return q, steps
    if dataset_size and batch_size and epochs:
        if batch_size >= dataset_size:
            raise DpltmUserError("--batch-size must be smaller than --dataset-size")
        return batch_size / dataset_size, epochs * math.ceil(dataset_size / batch_size)
    raise DpltmUserError("give --q and --steps, or --dataset-size, --batch-size and --epochs")


def account_report(*, q: float | None, sigma: float | None, steps: int | None, delta: float,
                   dataset_size: int | None, batch_size: int | None, epochs: int | None,
                   eps: float | None, eps1: float | None) -> dict[str, Any]:
    rate, n_steps = _mechanism(q, steps, dataset_size, batch_size, epochs)
    rows: list[dict[str, Any]] = []
    if eps is not None:
        for name in SOUND:
            s = calibrate_noise_multiplier(rate, n_steps, eps, delta, name, selection_eps1=eps1)
            rows.append({"accountant": name, "sigma": s, "epsilon": eps, "kind": "upper bound"})
        return {"q": rate, "steps": n_steps, "delta": delta, "target_epsilon": eps, "eps1": eps1, "rows": rows}
    if sigma is None:
        raise DpltmUserError("give --sigma (to get ε) or --eps (to get σ)")
    event = dpsgd_event(rate, sigma, n_steps)
    for name in SOUND:
        row: dict[str, Any] = {"accountant": name, "epsilon": epsilon(event, delta, name), "kind": "upper bound"}
        if eps1 is not None:
            best = min(composition_bounds(eps1, event, delta, name), key=lambda b: b.epsilon)
            row["with_selection"] = best.epsilon
            row["composition"] = best.name
        rows.append(row)
    mu = gdp_mu(rate, sigma, n_steps)
    rows.append({"accountant": "gdp", "epsilon": gdp_epsilon(mu, delta), "mu": mu,
                 "kind": "APPROXIMATION (CLT; may fall below the true ε)"})
    return {"q": rate, "sigma": sigma, "steps": n_steps, "delta": delta, "eps1": eps1, "rows": rows}


def print_account_report(report: dict[str, Any], console: Console) -> None:
    solving = "target_epsilon" in report
    title = (f"σ for ε = {report['target_epsilon']:g}" if solving else f"ε for σ = {report['sigma']:g}")
    table = Table(title=f"{title}, q = {report['q']:.5g}, T = {report['steps']}, δ = {report['delta']:g}")
    table.add_column("accountant")
    table.add_column("σ" if solving else "ε", justify="right")
    if report.get("eps1") is not None and not solving:
        table.add_column(f"ε with ε1 = {report['eps1']:g} selection", justify="right")
    table.add_column("status")
    for row in report["rows"]:
        cells = [row["accountant"], f"{row['sigma' if solving else 'epsilon']:.4f}"]
        if report.get("eps1") is not None and not solving:
            cells.append(f"{row['with_selection']:.4f} ({row['composition']})" if "with_selection" in row else "-")
        cells.append(row["kind"])
        table.add_row(*cells)
    console.print(table)
