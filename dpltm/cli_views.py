"""What each command prints: the human lines (the result on stdout, notes on stderr) or, with
`--json`, one JSON report alone on stdout so the output can be piped."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.cli_runtime import emit_json
from dpltm.console import err_console, out_console
from dpltm.privacy.display import format_epsilon

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, Winner
    from dpltm.artefacts.trained_model import TrainingReport


def known_accuracy(value: float | None) -> float | None:
    """An accuracy, or None where there was nothing to measure it on (NaN: no validation records)."""
    return None if value is None or value != value else float(value)


def accuracy_text(value: float | None, what: str = "validation accuracy") -> str:
    known = known_accuracy(value)
    return f"{what} {known:.4f}" if known is not None else "(no validation set)"


def _say(text: str) -> None:
    err_console.print(text, markup=False, highlight=False)


def show_generated(made: TicketSet | Winner, target: Path, json_out: bool) -> None:
    """`generate`: the ticket set's table, or its JSON view (phase 1's record with where it ran); with
    `--private` the ticket, what it spent (computed from its DpEvent), and how to train it."""
    from dpltm.artefacts import Winner
    from dpltm.ticket_views import print_tickets, tickets_json

    if not isinstance(made, Winner):
        if json_out:
            emit_json({**tickets_json(made), "output": str(target)})
            return
        print_tickets(made, err_console)
        err_console.print(f"ticket file: {target}")
        return
    record = made.private_ticket
    assert record is not None  # `generate --private` makes a private ticket
    privacy = made.privacy_view
    if json_out:
        emit_json({"output": str(target), "density": made.density, "layer_density": made.layer_density,
                   "val_accuracy": known_accuracy(made.val_accuracy), "privacy": privacy,
                   "private_ticket": {k: v for k, v in record.to_dict().items() if k != "dp_event"}})
        return
    out_console.print(f"private ticket: C={made.density:.4f}, {accuracy_text(made.val_accuracy)}",
                      markup=False, highlight=False)
    out_console.print(privacy["statement"], markup=False, highlight=False)
    err_console.print(f"train it with: dpltm train --ticket {target} --dataset {made.dataset} (σ is calibrated so "
                      f"the whole run meets ε = {format_epsilon(record.epsilon_total)})")


def show_winner(winner: Winner, target: Path, json_out: bool) -> None:
    """`select`: the stage has printed the choice on stderr; `--json` adds the record on stdout."""
    from dpltm.stages.select import same_data_note

    if json_out:
        emit_json({"winner_round": winner.round, "density": winner.density,
                   "val_accuracy": winner.val_accuracy, "selection": winner.selection,
                   "tickets": winner.source["tickets"], "ticket_data": winner.source_data,
                   "same_data_note": same_data_note(winner.source_data), "output": str(target)})


def show_training(report: TrainingReport, json_out: bool) -> None:
    """`train` and `run`: the summary (rank 0 of a multi-device run alone)."""
    from dpltm.dp.distributed import is_main_process
    from dpltm.stages.train import print_training_report

    if not is_main_process():  # another rank of a multi-device run: rank 0 reports
        return
    print_training_report(report, err_console if json_out else out_console)  # the result on stdout
    if json_out:
        emit_json({k: v for k, v in report.to_json().items() if k != "statement"})


def show_predictions(report: dict[str, Any], json_out: bool) -> None:
    """`predict`: accuracy on the records, where the predictions went, the model's privacy statement."""
    if report["warning"]:
        _say(f"warning: {report['warning']}")
    if json_out:
        emit_json({k: v for k, v in report.items() if k != "statement"} | {"statement": report["statement"]})
        return
    err_console.print(f"{report['dataset']} {report['part']} set: accuracy {report['accuracy']:.4f} on "
                      f"{report['records']} records ({report['model_format']} {report['model']})"
                      + (f"; predictions: {report['predictions']}" if report["predictions"] else ""))
    if report["statement"]:
        _say(report["statement"])


def show_export(exported: dict[str, Any], model: Path, json_out: bool) -> None:
    """`export`: the file written and the privacy statement it carries."""
    if json_out:
        emit_json({k: v for k, v in exported.items() if k != "privacy_statement"})
        return
    err_console.print(f"exported {model} to {exported['output']}")
    _say(exported["privacy_statement"])


def show_audit(report: TrainingReport, json_out: bool) -> None:
    """`audit`: the empirical lower bound beside the accountant's claim, and the verdict."""
    from dpltm.privacy.display import round_down

    result = report.audit
    assert result is not None  # an audited run's report
    if report.warning:  # as `dpltm train` says it: a same-data ticket makes the run NOT end-to-end DP
        _say(report.warning)
    if json_out:
        emit_json({**result, **{key: getattr(report, key) for key in (
            "test_accuracy", "noise_multiplier", "sample_rate", "steps", "dataset", "end_to_end_dp", "epsilon",
            "epsilon_dp_part", "epsilon_scope", "warning")}})
        return
    verdict = (f"REFUTED: the lower bound exceeds the claim; the mechanism that ran is likely not the one accounted "
               f"(a correct one is refuted with probability ≤ {1 - result['confidence']:.0%})"
               if result["refuted"] else "consistent: the attack does not refute the claim")
    err_console.print(f"audit ({result['threat_model']}, {result['canaries']} canaries, {result['observed']}): "
                      f"ε ≥ {round_down(result['epsilon_lower_bound'], 3)} at {result['confidence']:.0%} confidence; "
                      f"claimed ε = {format_epsilon(result['epsilon_claimed'])} (the training mechanism alone; "
                      f"{run_epsilon_phrase(report)}, scope: {report.epsilon_scope}); {verdict}")
    _say(result["unaccounted"])


def run_epsilon_phrase(report: TrainingReport) -> str:
    """The run's own ε as `dpltm train` states it: ∞ when it is not DP end to end (a same-data ticket), with its DP
    part beside it, never the DP part alone as if it were the run's."""
    part = format_epsilon(report.epsilon_dp_part)
    if report.end_to_end_dp is not False and report.epsilon not in (math.inf, "inf", "Infinity"):
        return f"the run's ε = {part}"
    return f"the run's ε = ∞, not DP end to end (its DP phases alone: ε = {part})"
