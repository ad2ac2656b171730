"""`dpltm account`: ε of DP-SGD by every accountant, side by side, or σ for a target ε.

`--noise` names the plug-in whose parameter `--sigma` is (dpltm/dp/plugins.py):
the sound accountants always see its effective add/remove multiplier (for `dpd`, 2σ). For
`dpd` one more row shows what the DPD paper's own zCDP accounting would claim
(dpltm.privacy.comparisons), labelled as a comparison: it is never a bound.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from dpltm.dp.plugins import noise_plugin
from dpltm.errors import DpltmUserError
from dpltm.privacy.accountants import ACCOUNTANTS
from dpltm.privacy.accounting import (
    NEIGHBORING_LABELS,
    AccountantUnderflow,
    check_target_epsilon,
    composition_bounds,
    epsilon,
    gdp_epsilon,
    gdp_mu,
    make_accountant,
    require_delta,
)
from dpltm.privacy.calibration import calibrate_noise_multiplier
from dpltm.privacy.comparisons import COMPARISON_LABEL, dpd_paper_figure, dpd_paper_sigma
from dpltm.privacy.display import format_delta, format_epsilon, format_rate, format_sigma, round_up
from dpltm.privacy.events import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER, check_steps, dpsgd_event, selection_event

SOUND = tuple(ACCOUNTANTS)


def _positive_int(option: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise DpltmUserError(f"{option} must be a positive integer, got {value}")
    return int(value)


def _mechanism(q: float | None, steps: int | None, dataset_size: int | None, batch_size: int | None,
               epochs: int | None) -> tuple[float, int]:
    """(q, T) from exactly one of the two ways to give them; mixing the two is refused."""
    direct = {"--q": q, "--steps": steps}
    derived = {"--dataset-size": dataset_size, "--batch-size": batch_size, "--epochs": epochs}
    given_direct = [k for k, v in direct.items() if v is not None]
    given_derived = [k for k, v in derived.items() if v is not None]
    if given_direct and given_derived:
        raise DpltmUserError(f"give --q and --steps, or --dataset-size, --batch-size and --epochs, not both "
                             f"(got {', '.join(given_direct + given_derived)})")
    if q is not None and steps is not None:
        rate = float(q)
        if not (math.isfinite(rate) and 0.0 < rate <= 1.0):
            raise DpltmUserError(f"--q must lie in (0, 1], got {q}")
        return rate, check_steps(steps)
    if dataset_size is not None and batch_size is not None and epochs is not None:
        n = _positive_int("--dataset-size", dataset_size)
        size = _positive_int("--batch-size", batch_size)
        rounds = _positive_int("--epochs", epochs)
        if size >= n:
            raise DpltmUserError("--batch-size must be smaller than --dataset-size")
        return size / n, check_steps(rounds * math.ceil(n / size))
    raise DpltmUserError("give --q and --steps, or --dataset-size, --batch-size and --epochs")


def account_report(*, q: float | None, sigma: float | None, steps: int | None, delta: float,
                   dataset_size: int | None, batch_size: int | None, epochs: int | None,
                   eps: float | None, eps1: float | None, noise: str = "gaussian",
                   neighboring: str = "add_remove") -> dict[str, Any]:
    """Every input is validated here, once, before any accountant runs. `neighboring`: the relation every
    ε is stated for (add/remove-one with N public, or replace-one); the GDP CLT row is add/remove only."""
    if sigma is not None and eps is not None:
        raise DpltmUserError("give --sigma (to get ε) or --eps (to get σ), not both")
    if sigma is None and eps is None:
        raise DpltmUserError("give --sigma (to get ε) or --eps (to get σ)")
    rate, n_steps = _mechanism(q, steps, dataset_size, batch_size, epochs)
    delta = require_delta(delta)
    if eps1 is not None:
        selection_event(eps1)  # validates ε1
    if eps is not None:
        eps = check_target_epsilon(eps, "--eps")
    if sigma is not None and not (math.isfinite(sigma) and MIN_NOISE_MULTIPLIER <= sigma <= MAX_NOISE_MULTIPLIER):
        raise DpltmUserError(f"--sigma must be a finite number in [{MIN_NOISE_MULTIPLIER:g}, "
                             f"{MAX_NOISE_MULTIPLIER:g}], got {sigma}")
    mechanism = noise_plugin(noise)
    rows: list[dict[str, Any]] = []
    if eps is not None:
        failures: list[AccountantUnderflow] = []
        for name in _supported(dpsgd_event(rate, 1.0, n_steps), neighboring, rows, "sigma"):
            try:
                s = calibrate_noise_multiplier(rate, n_steps, eps, delta, name, neighboring, selection_eps1=eps1)
            except AccountantUnderflow as error:  # this accountant cannot state the target (another may)
                failures.append(error)
                rows.append({"accountant": name, "sigma": None, "kind": f"no σ: {error}"})
                continue
            rows.append({"accountant": name, "sigma": mechanism.parameter_for(s), "effective_sigma": s,
                         "epsilon": eps, "kind": "upper bound"})
        if failures and all(row.get("sigma") is None for row in rows):
            raise failures[0]
        if noise == "dpd":
            rows.append({"accountant": "dpd-paper-zcdp", "sigma": dpd_paper_sigma(eps, rate, n_steps, delta),
                         "epsilon": eps, "kind": COMPARISON_LABEL})
        return {"q": rate, "steps": n_steps, "delta": delta, "target_epsilon": eps, "eps1": eps1, "noise": noise,
                "neighboring": neighboring, "rows": rows}
    assert sigma is not None
    parameter, sigma = sigma, mechanism.effective_for(sigma)  # the accountants see the effective multiplier
    event = dpsgd_event(rate, sigma, n_steps)
    for name in _supported(event, neighboring, rows, "epsilon"):
        try:
            bound = epsilon(event, delta, name, neighboring)
        except AccountantUnderflow as error:  # RDP's underflow at a huge σ: no bound from this accountant
            rows.append({"accountant": name, "epsilon": None, "kind": f"no bound: {error}"})
            continue
        row: dict[str, Any] = {"accountant": name, "epsilon": bound, "kind": "upper bound"}
        if eps1 is not None:
            best = min(composition_bounds(eps1, event, delta, name, neighboring), key=lambda b: b.epsilon)
            row["with_selection"] = best.epsilon
            row["composition"] = best.name
        rows.append(row)
    if neighboring == "add_remove":  # the CLT's μ (Bu et al. 2020) is derived for add/remove
        mu = gdp_mu(rate, sigma, n_steps)
        rows.append({"accountant": "gdp", "epsilon": gdp_epsilon(mu, delta), "mu": mu,
                     "kind": "APPROXIMATION (CLT; may fall below the true ε)"})
    if noise == "dpd":
        paper = dpd_paper_figure(parameter, rate, n_steps, delta)
        rows.append({"accountant": "dpd-paper-zcdp", "epsilon": paper.epsilon, "compositions": paper.compositions,
                     "kind": COMPARISON_LABEL})
    return {"q": rate, "sigma": parameter, "effective_sigma": sigma, "noise": noise, "steps": n_steps,
            "delta": delta, "eps1": eps1, "neighboring": neighboring, "rows": rows}


def _supported(event: Any, neighboring: str, rows: list[dict[str, Any]], key: str) -> list[str]:
    """The sound accountants that can state `event` under `neighboring`; a row saying so for the others
    (dp-accounting's RDP accountant has no replace-one analysis of Poisson sampling)."""
    names = []
    for name in SOUND:
        if make_accountant(name, neighboring).supports(event):
            names.append(name)
        else:
            rows.append({"accountant": name, key: None,
                         "kind": f"not available under {NEIGHBORING_LABELS[neighboring]}"})
    if not names:
        raise DpltmUserError(f"no accountant states this run under {NEIGHBORING_LABELS[neighboring]} adjacency")
    return names


def print_account_report(report: dict[str, Any], console: Console) -> None:
    solving = "target_epsilon" in report
    title = (f"σ for ε = {format_epsilon(report['target_epsilon'])}" if solving
             else f"ε for σ = {format_sigma(report['sigma'])}")
    noise = report.get("noise", "gaussian")
    if noise != "gaussian":
        title = f"{title} ({noise} noise" + (
            f"; accountants see the effective multiplier {format_sigma(report['effective_sigma'])})" if not solving
            else "; σ is the plug-in's own parameter)")
    relation = NEIGHBORING_LABELS[report.get("neighboring", "add_remove")]
    table = Table(title=f"{title}, q = {format_rate(report['q'], 5)}, T = {report['steps']}, δ = "
                        f"{format_delta(report['delta'])}, "
                        f"{relation} adjacency")
    table.add_column("accountant")
    table.add_column("σ" if solving else "ε", justify="right")
    if report.get("eps1") is not None and not solving:
        table.add_column(f"ε with ε1 = {format_epsilon(report['eps1'])} selection", justify="right")
    table.add_column("status")
    for row in report["rows"]:
        # ε and σ shown rounded up: a displayed ε never understates, a displayed σ always suffices
        figure = row["sigma" if solving else "epsilon"]
        cells = [row["accountant"], "-" if figure is None else round_up(figure, 5)]
        if report.get("eps1") is not None and not solving:
            cells.append(f"{round_up(row['with_selection'], 5)} ({row['composition']})" if "with_selection" in row
                         else "-")
        cells.append(row["kind"])
        table.add_row(*cells)
    console.print(table)
