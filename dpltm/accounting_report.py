"""`dpltm account`: ε of DP-SGD by every accountant, side by side, or σ for a target ε.

`--noise` names the plug-in whose parameter `--sigma` is (dpltm.dp.noise.NOISE_MECHANISMS):
the sound accountants always see its effective add/remove multiplier (for `dpd`, 2σ). For
`dpd` one more row shows what the DPD paper's own zCDP accounting would claim
(dpltm.privacy.comparisons), labelled as a comparison: it is never a bound.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from dpltm.dp.noise import noise_class
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import composition_bounds, epsilon, gdp_epsilon, gdp_mu
from dpltm.privacy.calibration import calibrate_noise_multiplier
from dpltm.privacy.comparisons import COMPARISON_LABEL, dpd_paper_figure, dpd_paper_sigma
from dpltm.privacy.events import dpsgd_event
from dpltm.privacy.ledger import _round_up

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
                   eps: float | None, eps1: float | None, noise: str = "gaussian") -> dict[str, Any]:
    rate, n_steps = _mechanism(q, steps, dataset_size, batch_size, epochs)
    mechanism = noise_class(noise)
    rows: list[dict[str, Any]] = []
    if eps is not None:
        for name in SOUND:
            s = calibrate_noise_multiplier(rate, n_steps, eps, delta, name, selection_eps1=eps1)
            rows.append({"accountant": name, "sigma": mechanism.parameter_for(s), "effective_sigma": s,
                         "epsilon": eps, "kind": "upper bound"})
        if noise == "dpd":
            rows.append({"accountant": "dpd-paper-zcdp", "sigma": dpd_paper_sigma(eps, rate, n_steps, delta),
                         "epsilon": eps, "kind": COMPARISON_LABEL})
        return {"q": rate, "steps": n_steps, "delta": delta, "target_epsilon": eps, "eps1": eps1, "noise": noise,
                "rows": rows}
    if sigma is None:
        raise DpltmUserError("give --sigma (to get ε) or --eps (to get σ)")
    parameter, sigma = sigma, mechanism.effective_for(sigma)  # the accountants see the effective multiplier
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
    if noise == "dpd":
        paper = dpd_paper_figure(parameter, rate, n_steps, delta)
        rows.append({"accountant": "dpd-paper-zcdp", "epsilon": paper.epsilon, "compositions": paper.compositions,
                     "kind": COMPARISON_LABEL})
    return {"q": rate, "sigma": parameter, "effective_sigma": sigma, "noise": noise, "steps": n_steps,
            "delta": delta, "eps1": eps1, "rows": rows}


def print_account_report(report: dict[str, Any], console: Console) -> None:
    solving = "target_epsilon" in report
    title = (f"σ for ε = {report['target_epsilon']:g}" if solving else f"ε for σ = {report['sigma']:g}")
    noise = report.get("noise", "gaussian")
    if noise != "gaussian":
        title = f"{title} ({noise} noise" + (
            f"; accountants see the effective multiplier {report['effective_sigma']:g})" if not solving
            else "; σ is the plug-in's own parameter)")
    table = Table(title=f"{title}, q = {report['q']:.5g}, T = {report['steps']}, δ = {report['delta']:g}")
    table.add_column("accountant")
    table.add_column("σ" if solving else "ε", justify="right")
    if report.get("eps1") is not None and not solving:
        table.add_column(f"ε with ε1 = {report['eps1']:g} selection", justify="right")
    table.add_column("status")
    for row in report["rows"]:
        # ε and σ shown rounded up: a displayed ε never understates, a displayed σ always suffices
        cells = [row["accountant"], _round_up(row["sigma" if solving else "epsilon"], 5)]
        if report.get("eps1") is not None and not solving:
            cells.append(f"{_round_up(row['with_selection'], 5)} ({row['composition']})" if "with_selection" in row
                         else "-")
        cells.append(row["kind"])
        table.add_row(*cells)
    console.print(table)
