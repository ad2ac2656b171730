"""Human and JSON views of ticket files (what `dpltm inspect` prints)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, TrainedModel, Winner
    from dpltm.networks.lenet import Architecture


def ticket_rows(tickets: TicketSet) -> list[dict[str, Any]]:
    rows = []
    for t in tickets.tickets:
        row = {"round": t.round, "density": t.density, "layer_density": t.layer_density,
               "val_accuracy": t.val_accuracy, "final_loss": t.loss_curve[-1] if t.loss_curve else None}
        if t.controls is not None:
            row["controls"] = t.controls
        rows.append(row)
    return rows


def tickets_json(tickets: TicketSet, file_header: bool = False) -> dict[str, Any]:
    """Everything in a ticket file except tensors (and, unless `file_header`, the format's header), phase 1's
    record with where it ran."""
    from dpltm.artefacts.format import HEADER_KEYS

    skip = {"theta0", "tickets", "next_masks", "rewind_point", *(() if file_header else HEADER_KEYS)}
    meta = {k: v for k, v in tickets.to_dict().items() if k not in skip}
    return {**meta, "privacy": tickets.privacy_view, "rewind_step": tickets.rewind_step or None,
            "tickets": ticket_rows(tickets)}


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def arch_text(arch: Architecture) -> str:
    """A network in one phrase: layer widths, convolutions, projection (a network of its own file: its
    name first)."""
    return _widths(arch) + _projection(arch) + (f", {arch.activation}" if arch.activation else "")


def _widths(arch: Architecture) -> str:
    named = f"{arch.name} " if arch.name else ""
    return (f"{named}{arch.in_features}-" + "".join(f"conv{c[0]}@{c[1]}x{c[1]}-" for c in arch.conv)
            + f"{'-'.join(map(str, arch.hidden))}-{arch.num_classes}")


def _projection(arch: Architecture) -> str:
    return f", projection {arch.project_to}" if arch.project_to else ""


def print_tickets(tickets: TicketSet, console: Console) -> None:
    data, rounds = tickets.data, tickets.tickets
    layers = list(rounds[0].layer_density) if rounds else []
    table = Table(title=f"tickets: {tickets.dataset} ({tickets.split} split), " + _widths(tickets.arch)
                        + _projection(tickets.arch))
    table.add_column("round", justify="right")
    table.add_column("C", justify="right")
    for name in layers:
        table.add_column(f"C {name.removesuffix('.weight')}", justify="right")
    table.add_column("val acc (A)", justify="right")
    has_controls = any(t.controls is not None for t in rounds)
    if has_controls:
        table.add_column("reinit val", justify="right")
        table.add_column("random-mask val", justify="right")
    for t in rounds:
        cells = [str(t.round), _fmt(t.density), *(_fmt(t.layer_density[n]) for n in layers), _fmt(t.val_accuracy)]
        if has_controls:
            c = t.controls or {}
            cells += [_fmt(c.get("reinit", {}).get("val_accuracy")),
                      _fmt(c.get("random_mask", {}).get("val_accuracy"))]
        table.add_row(*cells)
    console.print(table)
    status = "complete" if tickets.complete else "INCOMPLETE (rerun generate to resume)"
    console.print(f"status: {status}; {tickets.stop_reason or ''}")
    k = tickets.rewind_step
    if k:
        console.print(f"late rewinding: the rounds after the first rewound to θ_{k}, the dense network "
                      f"after {k} steps (kept: train --rewind {k} starts there)")
    sizes = " / ".join(f"{data.get(f'n_{part}', '?')} {part}" for part in ("train", "val", "test"))  # '?': not kept
    console.print(f"data: {sizes}, fingerprint {tickets.fingerprint}; seed {tickets.seed}; "
                  f"generation time {tickets.wall_seconds or 0:.0f} s")
    console.print(f"privacy: phase 1 ran WITHOUT privacy on {tickets.dataset} ({tickets.split}). "
                  "DP training on this same data would not be end-to-end DP; on other data these "
                  "tickets are public.")


# ---- `dpltm inspect`'s other views: tables of fields, never a dict's or a list's repr -------------
def cell(key: str, value: Any) -> str:
    """One value as text: accuracies and densities to 4 digits, ε, δ and q rounded up and σ down (the guarantee
    never overstated), lists joined; nested values belong to `field_rows`."""
    name = key.rsplit(".", 1)[-1].lower()
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(key, v) for v in value) or "-"
    if isinstance(value, dict):  # only reached for a dict inside a list of scalars' place
        return "; ".join(f"{k} {cell(k, v)}" for k, v in value.items()) or "-"
    if isinstance(value, str) and value in ("inf", "-inf") and ("eps" in name or "epsilon" in name):
        return "∞" if value == "inf" else "-∞"
    if isinstance(value, float):
        if "accuracy" in name or "density" in name or name in ("c", "probabilities", "scores"):
            return _fmt(value)
        from dpltm.privacy.display import format_delta, format_rate, format_sigma, round_up

        if "eps" in name or "epsilon" in name:
            return round_up(value, 4)
        if "sigma" in name or name in ("noise_multiplier", "noise_parameter"):  # more noise shown: less privacy
            return format_sigma(value, 6)
        if name in ("q", "sample_rate"):
            return format_rate(value, 6)
        if "delta" in name:
            return format_delta(value, 6)
        return f"{value:.6g}"
    return str(value)


def field_rows(mapping: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """(field, text) rows: nested dicts as dotted names, a list of records as numbered names."""
    rows: list[tuple[str, str]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += field_rows(value, f"{name}.")
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value, 1):
                rows += field_rows(item, f"{name} {i}.")
        else:
            rows.append((name, cell(name, value)))
    return rows


def fields_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for name, text in rows:  # Text: a value is never read as rich markup
        table.add_row(Text(name), Text(text))
    return table


def records_table(title: str, records: list[dict[str, Any]]) -> Table:
    """Rows of like records (segments, epochs, bounds) under one header."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="left" if column in ("name", "description") else "right",
                         overflow="fold")
    for record in records:
        table.add_row(*(Text(cell(c, record.get(c))) for c in columns))
    return table


def _print_statement(console: Console, statement: str) -> None:
    console.print(statement, markup=False, highlight=False)


def _environment(env: dict[str, str] | None, console: Console) -> None:
    if env:
        console.print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), markup=False,
                      highlight=False)


def print_ledger(ledger: dict[str, Any], console: Console) -> None:
    shown = {k: v for k, v in ledger.items() if k not in ("format_version", "bounds", "warning")}
    console.print(fields_table("privacy ledger", field_rows(shown)))
    if ledger.get("bounds"):
        console.print(records_table("bounds (the best one is the ledger's ε)", ledger["bounds"]))


def print_model(trained: TrainedModel, console: Console) -> None:
    head = {"dataset": trained.dataset, "network": arch_text(trained.arch),
            "test_accuracy": trained.test_accuracy, "val_accuracy": trained.val_accuracy,
            "epochs_run": trained.epochs_run, "steps": trained.outcome.steps,
            "released_weights": trained.outcome.released_weights, "dpltm_version": trained.dpltm_version}
    console.print(fields_table("model", field_rows(head)))
    if trained.ticket:
        console.print(fields_table("ticket it was trained from", field_rows(trained.ticket)))
    print_ledger(trained.privacy.ledger_report, console)
    _environment(trained.environment, console)
    _print_statement(console, trained.privacy.ledger.statement())


def print_winner(winner: Winner, console: Console) -> None:
    k = winner.rewind_step
    head = {"round": winner.round, "density": winner.density, "val_accuracy": winner.val_accuracy,
            "network": arch_text(winner.arch), "dpltm_version": winner.dpltm_version,
            "public_weights": "kept (train --rewind public)" if winner.public_weights is not None else "none",
            "iterate K of public training": f"θ_{k} kept (train --rewind {k})" if k else "none"}
    console.print(fields_table("ticket (winner)", field_rows(head)))
    layers = Table(title="surviving fraction per layer", title_justify="left")
    layers.add_column("layer")
    layers.add_column("C", justify="right")
    for name, value in winner.layer_density.items():
        layers.add_row(Text(name), _fmt(value))
    console.print(layers)
    selection = dict(winner.selection)
    noise_aware = selection.pop("noise_aware", None)
    console.print(fields_table("selection", field_rows(selection)))
    if noise_aware:
        console.print(records_table("noise-aware candidates (public validation accuracy after the planned run)",
                                    noise_aware.get("candidates", [])))
        rest = {k: v for k, v in noise_aware.items() if k != "candidates"}
        console.print(fields_table("noise-aware plan", field_rows(rest)))
    console.print(fields_table("ticket data", field_rows(winner.source_data)))
    privacy = dict(winner.privacy_view)
    statement = privacy.pop("statement", None)
    console.print(fields_table("privacy", field_rows(privacy)))
    _environment(winner.environment, console)
    if statement:
        _print_statement(console, statement)


def run_summary(body: dict[str, Any]) -> dict[str, Any]:
    """`inspect`'s view of a library run (kind "run", `PrivateTraining.save`): what it spent, segment by
    segment, its epochs, and the statement of its ledger."""
    from dpltm.privacy.ledger import PrivacyLedger, before_any_step

    ledger = None if body.get("ledger") is None else PrivacyLedger.from_json(body["ledger"])
    return {"kind": "run", "dataset": body["dataset_name"], "dataset_size": body["dataset_size"],
            "epochs_done": body["epochs_done"], "steps": sum(int(s["steps"]) for s in body["segments"]),
            "optimizer": body.get("optimizer_class"), "masks_from": body.get("masks_from"),
            "masks_private": body.get("masks_private"), "settings": body["settings"],
            "segments": body["segments"], "history": body["history"],
            "ledger": None if ledger is None else ledger.report(),
            "statement": before_any_step(bool(body.get("masks_from") and body.get("masks")),
                                         bool(body.get("masks_private")), body.get("selection_eps1"))[1]
            if ledger is None else ledger.statement()}


def print_run(summary: dict[str, Any], console: Console) -> None:
    """A library run (`make_private(...).save`): its settings, the segments it spent, its epochs."""
    head = {k: summary[k] for k in ("dataset", "dataset_size", "epochs_done", "steps", "optimizer",
                                      "masks_from", "masks_private")}
    console.print(fields_table("library run (make_private)", field_rows(head)))
    console.print(fields_table("settings", field_rows(summary["settings"])))
    if summary["segments"]:
        console.print(records_table("spent segments (composed by the ledger)", summary["segments"]))
    if summary["history"]:
        console.print(records_table("history", summary["history"]))
    if summary["ledger"] is not None:
        print_ledger(summary["ledger"], console)
    _print_statement(console, summary["statement"])


def print_export(exported: dict[str, Any], console: Console) -> None:
    shown = {k: exported.get(k) for k in ("format", "source_checkpoint", "test_accuracy", "data",
                                          "input_normalisation")}
    console.print(fields_table("export", field_rows(shown)))
    _environment(exported.get("environment"), console)
    _print_statement(console, exported["privacy_statement"])
