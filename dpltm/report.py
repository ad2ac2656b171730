"""Human and JSON views of ticket files (what `dpltm inspect` prints)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table


def ticket_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for t in payload["tickets"]:
        row = {
            "round": t["round"],
            "density": t["density"],
            "layer_density": t["layer_density"],
            "val_accuracy": t["val_accuracy"],
            "final_loss": t["loss_curve"][-1] if t["loss_curve"] else None,
        }
        if "controls" in t:
            row["controls"] = t["controls"]
        rows.append(row)
    return rows


def tickets_json(payload: dict[str, Any]) -> dict[str, Any]:
    """Everything in a ticket file except tensors."""
    skip = {"theta0", "tickets", "next_masks"}
    meta = {k: v for k, v in payload.items() if k not in skip}
    return {**meta, "tickets": ticket_rows(payload)}


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def print_tickets(payload: dict[str, Any], console: Console) -> None:
    data = payload["data"]
    arch = payload["architecture"]
    layers = list(payload["tickets"][0]["layer_density"]) if payload["tickets"] else []
    table = Table(title=f"tickets: {data['dataset']} ({data['split']} split), "
                        f"{arch['in_features']}-"
                        + "".join(f"conv{c[0]}@{c[1]}x{c[1]}-" for c in arch.get("conv", []))
                        + f"{'-'.join(map(str, arch['hidden']))}-{arch['num_classes']}"
                        + (f", projection {arch['project_to']}" if arch.get("project_to") else ""))
    table.add_column("round", justify="right")
    table.add_column("C", justify="right")
    for name in layers:
        table.add_column(f"C {name.removesuffix('.weight')}", justify="right")
    table.add_column("val acc (A)", justify="right")
    has_controls = any("controls" in t for t in payload["tickets"])
    if has_controls:
        table.add_column("reinit val", justify="right")
        table.add_column("random-mask val", justify="right")
    for t in payload["tickets"]:
        cells = [str(t["round"]), _fmt(t["density"])]
        cells += [_fmt(t["layer_density"][n]) for n in layers]
        cells += [_fmt(t["val_accuracy"])]
        if has_controls:
            c = t.get("controls", {})
            cells += [_fmt(c.get("reinit", {}).get("val_accuracy")),
                      _fmt(c.get("random_mask", {}).get("val_accuracy"))]
        table.add_row(*cells)
    console.print(table)
    status = "complete" if payload["complete"] else "INCOMPLETE (rerun generate to resume)"
    console.print(f"status: {status}; {payload.get('stop_reason') or ''}")
    console.print(f"data: {data['n_train']} train / {data['n_val']} val / {data['n_test']} test, "
                  f"fingerprint {data['fingerprint']}; seed {payload['seed']}; "
                  f"generation time {payload.get('wall_seconds', 0):.0f} s")
    console.print(f"privacy: phase 1 ran WITHOUT privacy on {data['dataset']} ({data['split']}). "
                  "DP training on this same data would not be end-to-end DP; on other data these "
                  "tickets are public.")
