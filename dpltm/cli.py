"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

from typing import Annotated

import typer

from dpltm.cli_options import request_command
from dpltm.cli_runtime import emit_json, run_app, user_errors
from dpltm.cli_views import (
    show_audit,
    show_export,
    show_generated,
    show_predictions,
    show_training,
    show_winner,
)
from dpltm.console import err_console, out_console
from dpltm.stages.audit import AuditRequest
from dpltm.stages.requests import GenerateRequest, SelectRequest
from dpltm.stages.run import RunRequest
from dpltm.stages.tools import (
    AccountRequest,
    DownloadRequest,
    ExportRequest,
    InspectRequest,
    PlotRequest,
    PredictRequest,
)
from dpltm.stages.train import TrainRequest

app = typer.Typer(
    name="dpltm",
    help="Differentially private training by way of lottery tickets (DPLTM).",
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from dpltm import __version__

        print(f"dpltm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print dpltm's version and exit.")] = False) -> None:
    """Differentially private training by way of lottery tickets (DPLTM)."""


def _warn(line: str) -> None:
    err_console.print(line, markup=False, highlight=False)


@app.command()
@user_errors
@request_command(GenerateRequest)
def generate(request: GenerateRequest) -> None:
    """Phase 1: lottery tickets by iterative magnitude pruning (non-private), or with --private one
    ticket made on the private data by DP warm-up (end-to-end DP with the training that follows)."""
    show_generated(*request.run(), request.json_out)


@app.command()
@user_errors
@request_command(InspectRequest)
def inspect(request: InspectRequest) -> None:
    """Show a dpltm file as tables: a ticket set's C per layer and accuracies; a winner's ticket and
    selection; a model's accuracy, ledger and privacy statement (recomputed from the ledger it
    carries); a library run's spent segments, epochs and statement."""
    summary, show = request.run(warn=_warn)
    if request.json_out:
        emit_json(summary)
    else:
        show(out_console)


@app.command()
@user_errors
@request_command(PredictRequest)
def predict(request: PredictRequest) -> None:
    """Run a trained model on a dataset: accuracy, and with --out the predictions (post-processing:
    no privacy is spent, except on the private training records themselves: --part train)."""
    show_predictions(request.run(), request.json_out)


@app.command("export")
@user_errors
@request_command(ExportRequest)
def export_command(request: ExportRequest) -> None:
    """Write a trained model as safetensors: weights (pruned ones exactly 0), masks, input
    normalisation, data settings, and the privacy statement and ledger as metadata."""
    show_export(request.run(warn=_warn), request.model, request.json_out)


@app.command()
@user_errors
@request_command(PlotRequest)
def plot(request: PlotRequest) -> None:
    """Draw a run's curves: accuracy and ε spent per epoch (train), or accuracy against the
    fraction of weights left (generate)."""
    err_console.print(f"figure: {request.run()}")


@app.command()
@user_errors
@request_command(DownloadRequest)
def download(request: DownloadRequest) -> None:
    """Fetch the official files into the data root, md5-checked (what --download does before a run)."""
    for summary in request.run():
        err_console.print(summary)


@app.command()
@user_errors
@request_command(SelectRequest)
def select(request: SelectRequest) -> None:
    """Phase 2: choose the winning ticket with the exponential mechanism (or --best)."""
    winner, target = request.run()
    show_winner(winner, target, request.json_out)


@app.command()
@user_errors
@request_command(TrainRequest)
def train(request: TrainRequest) -> None:
    """Phase 3: DP-SGD on the masked winner (or --dense / --non-private baselines)."""
    show_training(request.run(), request.json_out)


@app.command()
@user_errors
@request_command(AuditRequest)
def audit(request: AuditRequest) -> None:
    """Empirical lower bound on ε (Steinke, Nasr & Jagielski 2023): DP training exactly as `dpltm
    train` runs it, with m canaries each included with probability 1/2, then an attack's guesses turned
    into a lower bound at --confidence, beside the accountant's claim. Above the claim: a bug."""
    show_audit(request.run(), request.json_out)


@app.command()
@user_errors
@request_command(AccountRequest)
def account(request: AccountRequest) -> None:
    """ε of Poisson-subsampled Gaussian DP-SGD by each accountant, side by side (or σ for a target ε)."""
    from dpltm.accounting_report import print_account_report

    report = request.run()
    if request.json_out:
        emit_json(report)
    else:
        print_account_report(report, out_console)


@app.command()
@user_errors
@request_command(RunRequest)
def run(request: RunRequest) -> None:
    """All stages in a sound (end-to-end DP) mode: public tickets → noise-aware choice → DP training, or
    with --ticket-source private a ticket made on the private data by DP warm-up → DP training."""
    from dpltm.stages.run import stage_run

    show_training(stage_run(request), request.json_out)


def main() -> None:
    """Entry point (`dpltm`): usage errors and user mistakes as one line, signals as 128 + signum."""
    run_app(app)


if __name__ == "__main__":
    from dpltm.cli_runtime import exit_without_teardown

    main()
    exit_without_teardown()
