"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from dpltm import cli_options as opt
from dpltm.choices import (
    Dataset,
    Logger,
    Neighbouring,
    Noise,
    Part,
    Recipe,
    RunRecipe,
    Split,
    Strategy,
    ThreatModel,
    value,
)
from dpltm.console import err_console, kept_on_interrupt, on_interrupt_kept, out_console
from dpltm.errors import USER_ERRNOS, DpltmUserError, Interrupted, one_line, os_error_message
from dpltm.launch_env import check_rank_environment
from dpltm.paths import forget_inputs
from dpltm.run_log import check_logger
from dpltm.stages.generate import stage_generate, stage_generate_private
from dpltm.stages.select import NoiseAwareRequest, TicketChoice, TicketSource, same_data_note, stage_select
from dpltm.stages.train import print_training_report, stage_train

app = typer.Typer(
    name="dpltm",
    help="Differentially private training by way of lottery tickets (DPLTM).",
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
F = TypeVar("F", bound=Callable[..., Any])


def _print_version(value: bool) -> None:
    if value:
        from dpltm import __version__

        print(f"dpltm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print dpltm's version and exit.")] = False) -> None:
    """Differentially private training by way of lottery tickets (DPLTM)."""


def user_errors(func: F) -> F:
    """Turn user mistakes into one clear line and exit 2; a signal into one line and 128 + signum."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        on_interrupt_kept("nothing was written")
        forget_inputs()
        try:
            check_rank_environment()  # before Lightning's import parses them
            return func(*args, **kwargs)
        except DpltmUserError as exc:
            typer.echo(f"dpltm: error: {one_line(str(exc))}", err=True)
            raise typer.Exit(2) from None
        except OSError as exc:  # a full disk, a name too long: the user's to fix (written files are cleaned)
            if exc.errno not in USER_ERRNOS:
                raise
            typer.echo(f"dpltm: error: {one_line(os_error_message(exc))}", err=True)
            raise typer.Exit(2) from None
        except (KeyboardInterrupt, Interrupted) as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            # on a line of its own: a progress bar may have left the cursor at the end of its line
            typer.echo(f"\ndpltm: interrupted ({signal.Signals(signum).name}); {kept_on_interrupt()}", err=True)
            raise typer.Exit(128 + signum) from None

    return wrapper  # type: ignore[return-value]


_UNWINDING: list[int] = []
"""The signal a run is unwinding from; while set, further signals are ignored."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Signal handler: unwind the run as an exception (temp files are cleaned on the way out).
    Further signals are ignored while it unwinds, so the clean-up itself is not cut short: the
    handler sets SIG_IGN, and since Lightning's signal connector may put this handler back during its
    own tear-down, the handler itself also ignores every signal after the first."""
    if _UNWINDING:
        return
    _UNWINDING.append(signum)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def _floats(text: str | None, option: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise DpltmUserError(f"{option} takes comma-separated numbers, got '{text}'") from None


def _ints(text: str | None, option: str) -> tuple[int, ...] | None:
    values = _floats(text, option)
    if values is None:
        return None
    if any(not v.is_integer() or v <= 0 for v in values):
        raise DpltmUserError(f"{option} takes positive integers, got '{text}'")
    return tuple(int(v) for v in values)


def emit_json(report: dict[str, Any]) -> None:
    from dpltm.strict_json import dumps

    sys.stdout.write(dumps(report) + "\n")


def finish_training_report(report: dict[str, Any], json_out: bool) -> None:
    from dpltm.dp.distributed import is_main_process

    if not is_main_process():  # another rank of a multi-device run: rank 0 reports
        return
    print_training_report(report, err_console if json_out else out_console)  # the result on stdout
    if json_out:
        emit_json({k: v for k, v in report.items() if k != "statement"})






def _model_cli(arch: str | None, hidden: str | None, **rest: Any) -> dict[str, Any]:
    """The `model:` part of a command's settings (dpltm.architectures.model_cli)."""
    from dpltm.architectures import model_cli

    return model_cli(arch, _ints(hidden, "--hidden"), **rest)




@app.command()
@user_errors
def generate(
    dataset: opt.GenerateDataset = None,
    split: opt.SplitOption = None,
    rounds: opt.GenerateRounds = None,
    iterations: opt.GenerateIterations = None,
    batch_size: opt.GenerateBatchSize = None,
    lr: opt.GenerateLr = None,
    prune_rates: opt.GeneratePruneRates = None,
    min_density: opt.GenerateMinDensity = None,
    hidden: opt.GenerateHidden = None,
    arch: opt.ArchOption = None,
    project_to: opt.GenerateProjectTo = None,
    activation: opt.ActivationOption = None,
    controls: opt.GenerateControls = None,
    val_fraction: opt.ValFraction = None,
    seed: opt.GenerateSeed = None,
    private: opt.GeneratePrivate = False,
    eps: opt.GenerateEps = None,
    delta: opt.GenerateDelta = None,
    warmup_epochs: opt.GenerateWarmupEpochs = None,
    density: opt.GenerateDensity = None,
    rewind: opt.GenerateRewind = None,
    epochs: opt.GenerateEpochs = None,
    noise_seed: opt.GenerateNoiseSeed = None,
    device: opt.Device = "auto",
    cuda_graphs: opt.CudaGraphs = False,
    config: opt.ConfigFile = None,
    data_dir: opt.DataDir = None,
    download: opt.Download = False,
    out: opt.GenerateOut = None,
    overwrite: opt.GenerateOverwrite = False,
    progress: opt.GenerateProgress = True,
    logger: opt.LoggerOption = Logger.csv,
    log_dir: opt.LogDir = None,
    json_out: opt.Json = False,
) -> None:
    """Phase 1: lottery tickets by iterative magnitude pruning (non-private), or with --private one
    ticket made on the private data by DP warm-up (end-to-end DP with the training that follows)."""
    check_logger(value(logger))
    from dpltm.report import print_tickets, tickets_json

    dataset, split, arch, activation, rewind = map(value, (dataset, split, arch, activation, rewind))

    if private:
        imp_only = {"--iterations": iterations, "--prune-rates": prune_rates, "--min-density": min_density,
                    "--controls": controls, "--cuda-graphs": cuda_graphs or None}
        given = [name for name, value in imp_only.items() if value is not None]
        if given:
            raise DpltmUserError(f"{', '.join(given)} belong to non-private IMP: drop them with --private")
        if arch not in (None, "mlp"):
            raise DpltmUserError(f"--private makes MLP tickets; --arch {arch} is for public tickets "
                                 "(without --private)")
        private_cli = {
            "data": {"dataset": dataset, "split": split, "val_fraction": val_fraction},
            "model": _model_cli(arch, hidden, project_to=project_to, activation=activation),
            "train": {"eps2": eps, "delta": delta, "epochs": epochs,
                      "batch_size": batch_size, "lr": lr},
            "private_ticket": {"warmup_epochs": warmup_epochs, "rounds": rounds, "density": density,
                               "rewind": rewind},
            "seed": seed,
        }
        ticket, target = stage_generate_private(private_cli, config, data_dir, device, out, overwrite, progress,
                                                noise_seed, logger=value(logger), log_dir=log_dir, download=download)
        summary = {"output": str(target), "density": ticket["density"], "layer_density": ticket["layer_density"],
                   "val_accuracy": ticket["val_accuracy"], "privacy": ticket["privacy"],
                   "private_ticket": {k: v for k, v in ticket["private_ticket"].items() if k != "dp_event"}}
        if json_out:
            emit_json(summary)
        else:
            out_console.print(f"private ticket: C={ticket['density']:.4f}, validation accuracy "
                              f"{ticket['val_accuracy']:.4f}", markup=False, highlight=False)
            out_console.print(ticket["privacy"]["statement"], markup=False, highlight=False)
            err_console.print(f"train it with: dpltm train --ticket {target} --dataset "
                              f"{ticket['source']['data']['dataset']} (σ is calibrated so the whole run meets "
                              f"ε = {ticket['private_ticket']['epsilon_total']:g})")
        return
    private_only = {"--eps": eps, "--delta": delta, "--warmup-epochs": warmup_epochs, "--density": density,
                    "--rewind": rewind, "--epochs": epochs, "--noise-seed": noise_seed}
    given = [name for name, value in private_only.items() if value is not None]
    if given:
        raise DpltmUserError(f"{', '.join(given)} only apply with --private")
    cli = {
        "data": {"dataset": dataset, "split": split, "val_fraction": val_fraction},
        "model": _model_cli(arch, hidden, project_to=project_to, activation=activation),
        "generate": {
            "rounds": rounds, "iterations": iterations, "batch_size": batch_size, "lr": lr,
            "prune_rates": _floats(prune_rates, "--prune-rates"), "min_density": min_density,
            "controls": controls,
        },
        "seed": seed,
    }
    payload, target = stage_generate(cli, config, data_dir, device, out, overwrite, progress, cuda_graphs,
                                     logger=value(logger), log_dir=log_dir, download=download)
    if json_out:
        emit_json({**tickets_json(payload), "output": str(target)})
    else:
        print_tickets(payload, err_console)
        err_console.print(f"ticket file: {target}")


@app.command()
@user_errors
def inspect(
    path: opt.InspectPath,
    json_out: opt.Json = False,
) -> None:
    """Show a dpltm file as tables: a ticket set's C per layer and accuracies; a winner's ticket and
    selection; a model's accuracy, ledger and privacy statement (recomputed from the ledger it
    carries); a library run's spent segments, epochs and statement."""
    from dpltm.stages.inspect import inspect_file

    summary, show = inspect_file(path, warn=lambda line: err_console.print(line, markup=False, highlight=False))
    if json_out:
        emit_json(summary)
    else:
        show(out_console)


@app.command()
@user_errors
def predict(
    model: opt.PredictModel,
    dataset: opt.PredictDataset = None,
    split: opt.PredictSplit = None,
    part: opt.PredictPart = Part.test,
    device: opt.Device = "auto",
    data_dir: opt.DataDir = None,
    download: opt.Download = False,
    out: opt.PredictOut = None,
    overwrite: opt.PredictOverwrite = False,
    expose_training_records: opt.PredictExposeTrainingRecords = False,
    json_out: opt.Json = False,
) -> None:
    """Run a trained model on a dataset: accuracy, and with --out the predictions (post-processing:
    no privacy is spent, except on the private training records themselves: --part train)."""
    from dpltm.stages.predict import stage_predict

    report = stage_predict(model, value(dataset), value(part), data_dir, device, out, overwrite, download=download,
                           split=value(split), expose_training_records=expose_training_records)
    if report["warning"]:
        err_console.print(f"warning: {report['warning']}", markup=False, highlight=False)
    if json_out:
        emit_json({k: v for k, v in report.items() if k != "statement"} | {"statement": report["statement"]})
        return
    err_console.print(f"{report['dataset']} {report['part']} set: accuracy {report['accuracy']:.4f} on "
                      f"{report['records']} records ({report['model_format']} {report['model']})"
                      + (f"; predictions: {report['predictions']}" if report["predictions"] else ""))
    if report["statement"]:
        err_console.print(report["statement"], markup=False, highlight=False)


@app.command("export")
@user_errors
def export_command(
    model: opt.ExportModel,
    out: opt.ExportOut = None,
    overwrite: opt.ExportOverwrite = False,
    json_out: opt.Json = False,
) -> None:
    """Write a trained model as safetensors: weights (pruned ones exactly 0), masks, input
    normalisation, data settings, and the privacy statement and ledger as metadata."""
    from dpltm.stages.export import stage_export

    exported = stage_export(model, out, overwrite, warn=lambda line: err_console.print(line, markup=False,
                                                                                      highlight=False))
    if json_out:
        emit_json({k: v for k, v in exported.items() if k != "privacy_statement"})
        return
    err_console.print(f"exported {model} to {exported['output']}")
    err_console.print(exported["privacy_statement"], markup=False, highlight=False)


@app.command()
@user_errors
def plot(
    runs: opt.PlotRuns,
    out: opt.PlotOut = None,
    overwrite: opt.PlotOverwrite = False,
) -> None:
    """Draw a run's curves: accuracy and ε spent per epoch (train), or accuracy against the
    fraction of weights left (generate)."""
    from dpltm.plotting import plot_runs

    written = plot_runs(runs, out, overwrite)
    err_console.print(f"figure: {written}")


@app.command()
@user_errors
def download(
    datasets: opt.DownloadDatasets,
    data_dir: opt.DataDir = None,
    mirror: opt.DownloadMirror = None,
) -> None:
    """Fetch the official files into the data root, md5-checked (what --download does before a run)."""
    from dpltm.data.download import download_dataset

    for name in datasets:
        err_console.print(download_dataset(value(name), data_dir, mirror=mirror).summary())


@app.command()
@user_errors
def select(
    tickets: opt.SelectTickets = None,
    eps1: opt.SelectEps1 = None,
    nu: opt.SelectNu = None,
    best: opt.SelectBest = False,
    noise_aware: opt.SelectNoiseAware = False,
    private_size: opt.SelectPrivateSize = None,
    eps2: opt.SelectEps2 = None,
    sigma: opt.SelectSigma = None,
    epochs: opt.SelectEpochs = None,
    batch_size: opt.SelectBatchSize = None,
    device: opt.Device = "auto",
    data_dir: opt.DataDir = None,
    reselect: opt.SelectReselect = False,
    seed: opt.SelectSeed = None,
    config: opt.ConfigFile = None,
    out: opt.SelectOut = None,
    overwrite: opt.SelectOverwrite = False,
    progress: opt.SelectProgress = True,
    json_out: opt.Json = False,
) -> None:
    """Phase 2: choose the winning ticket with the exponential mechanism (or --best)."""
    if best and eps1 is not None:
        raise DpltmUserError("--best picks without privacy and spends no ε1: drop --eps1, or drop --best for the "
                             "exponential mechanism")
    if noise_aware and (best or eps1 is not None):
        raise DpltmUserError("--noise-aware is its own choice: drop --best/--eps1")
    planned = (eps2, sigma, epochs, batch_size, private_size)
    if not noise_aware and any(v is not None for v in planned):
        raise DpltmUserError("--private-size, --eps, --sigma, --epochs and --batch-size describe the planned run "
                             "of --noise-aware: add --noise-aware or drop them")
    if noise_aware and private_size is None:
        raise DpltmUserError("--noise-aware needs --private-size N, the private training set's size")
    if eps2 is not None and sigma is not None:
        raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma, not both")
    request = None if not noise_aware else NoiseAwareRequest(
        int(private_size),  # type: ignore[arg-type]
        {"train": {"eps2": eps2, "sigma": sigma, "epochs": epochs, "batch_size": batch_size}}, data_dir, device,
        progress)
    winner, target = stage_select({"select": {"eps1": eps1, "nu": nu}}, config, tickets, best, seed, out,
                                  overwrite=overwrite, reselect=reselect, noise_aware=request)
    if json_out:
        emit_json({"winner_round": winner["round"], "density": winner["density"],
                   "val_accuracy": winner["val_accuracy"], "selection": winner["selection"],
                   "tickets": winner["source"]["tickets"], "ticket_data": winner["source"]["data"],
                   "same_data_note": same_data_note(winner["source"]["data"]), "output": str(target)})


@app.command()
@user_errors
def train(
    ticket: opt.TrainTicket = None,
    dataset: opt.PrivateDataset = None,
    split: opt.SplitOption = None,
    eps2: opt.TrainEps2 = None,
    delta: opt.DeltaOption = None,
    sigma: opt.Sigma = None,
    epochs: opt.Epochs = None,
    batch_size: opt.BatchSize = None,
    clip: opt.Clip = None,
    lr: opt.LearningRate = None,
    recipe: opt.TrainRecipe = Recipe.paper,
    lr_sigma: opt.TrainLrSigma = None,
    optimizer: opt.OptimizerOption = None,
    momentum: opt.Momentum = None,
    ema: opt.TrainEma = None,
    activation: opt.TrainActivation = None,
    arch: opt.ArchOption = None,
    noise: opt.NoiseOption = None,
    accountant: opt.AccountantOption = None,
    neighbouring: opt.NeighbouringOption = None,
    max_eps: opt.TrainMaxEps = None,
    patience: opt.TrainPatience = None,
    dense: opt.TrainDense = False,
    non_private: opt.TrainNonPrivate = False,
    public_tickets: opt.TrainPublicTickets = False,
    val_fraction: opt.ValFraction = None,
    public_dataset: opt.TrainPublicDataset = None,
    public_split: opt.TrainPublicSplit = Split.train,
    seed: opt.Seed = None,
    noise_seed: opt.TrainNoiseSeed = None,
    device: opt.Device = "auto",
    devices: opt.TrainDevices = 1,
    num_nodes: opt.TrainNumNodes = 1,
    strategy: opt.TrainStrategy = Strategy.auto,
    cuda_graphs: opt.CudaGraphs = False,
    config: opt.ConfigFile = None,
    data_dir: opt.DataDir = None,
    download: opt.Download = False,
    out: opt.TrainOut = None,
    overwrite: opt.TrainOverwrite = False,
    progress: opt.TrainProgress = True,
    logger: opt.LoggerOption = Logger.csv,
    log_dir: opt.LogDir = None,
    json_out: opt.Json = False,
) -> None:
    """Phase 3: DP-SGD on the masked winner (or --dense / --non-private baselines)."""
    check_logger(value(logger))
    dataset, split, optimizer, activation, arch, noise, accountant = map(
        value, (dataset, split, optimizer, activation, arch, noise, accountant))
    if dense and ticket is not None:
        raise DpltmUserError("--dense trains the full network: drop --ticket")
    if dense and public_tickets:
        raise DpltmUserError("--public-tickets is about a ticket's data: drop it with --dense")
    if sigma is not None and eps2 is not None:
        raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma (ε is reported), not both")
    if non_private and (eps2 is not None or sigma is not None):
        raise DpltmUserError("--non-private trains without noise: drop --eps/--sigma")
    if not dense and ticket is None:
        raise DpltmUserError("give --ticket PATH (from `dpltm select`), or --dense for the DP-SGD baseline")
    if arch is not None and ticket is not None:
        raise DpltmUserError("--arch is for --dense: a ticket brings its own network")
    cli = {
        "data": {"dataset": dataset, "split": split, "val_fraction": val_fraction},
        "train": {"eps2": eps2, "delta": delta, "sigma": sigma, "epochs": epochs, "batch_size": batch_size,
                  "clip": clip, "lr": lr, "lr_sigma": lr_sigma, "optimizer": optimizer, "noise": noise,
                  "accountant": accountant,
                  "neighboring": neighbouring.relation if neighbouring is not None else None, "max_eps": max_eps,
                  "patience": patience, "momentum": momentum, "ema": ema},
        "model": _model_cli(arch, None, activation=activation),
        "seed": seed,
        "recipe": recipe.value,
    }
    from dpltm.dp.distributed import Distribution

    distribution = Distribution(devices, num_nodes, value(strategy))
    report = stage_train(cli, config, ticket, non_private, public_tickets, data_dir, device, out, progress,
                         public_data=(None if public_dataset is None
                                      else f"{value(public_dataset)}:{value(public_split)}"),
                         noise_seed=noise_seed, overwrite=overwrite,
                         distribution=distribution, cuda_graphs=cuda_graphs, logger=value(logger), log_dir=log_dir,
                         download=download)
    finish_training_report(report, json_out)


@app.command()
@user_errors
def audit(
    ticket: opt.AuditTicket = None,
    dense: opt.AuditDense = False,
    dataset: opt.PrivateDataset = None,
    split: opt.SplitOption = None,
    eps2: opt.AuditEps2 = None,
    sigma: opt.Sigma = None,
    delta: opt.DeltaOption = None,
    epochs: opt.Epochs = None,
    batch_size: opt.BatchSize = None,
    clip: opt.Clip = None,
    lr: opt.LearningRate = None,
    recipe: opt.AuditRecipe = Recipe.paper,
    optimizer: opt.OptimizerOption = None,
    momentum: opt.Momentum = None,
    activation: opt.ActivationOption = None,
    arch: opt.ArchOption = None,
    noise: opt.NoiseOption = None,
    accountant: opt.AccountantOption = None,
    canaries: opt.AuditCanaries = 1000,
    threat_model: opt.AuditThreatModel = ThreatModel.white_box,
    confidence: opt.AuditConfidence = 0.95,
    canary_seed: opt.AuditCanarySeed = None,
    seed: opt.Seed = None,
    noise_seed: opt.AuditNoiseSeed = None,
    device: opt.Device = "auto",
    config: opt.ConfigFile = None,
    data_dir: opt.DataDir = None,
    progress: opt.AuditProgress = True,
    json_out: opt.Json = False,
) -> None:
    """Empirical lower bound on ε (Steinke, Nasr & Jagielski 2023): DP training exactly as `dpltm
    train` runs it, with m canaries each included with probability 1/2, then an attack's guesses turned
    into a lower bound at --confidence, beside the accountant's claim. Above the claim: a bug."""
    from dpltm.audit.run import AuditPlan
    from dpltm.stages.audit import stage_audit

    if dense == (ticket is not None):
        raise DpltmUserError("give --ticket PATH (from `dpltm select`) or --dense")
    if arch is not None and ticket is not None:
        raise DpltmUserError("--arch is for --dense: a ticket brings its own network")
    if sigma is not None and eps2 is not None:
        raise DpltmUserError("give --eps (σ is calibrated to it) or --sigma (ε is reported), not both")
    plan = AuditPlan(value(threat_model), canaries, confidence, canary_seed)
    cli = {
        "data": {"dataset": value(dataset), "split": value(split)},
        "train": {"eps2": eps2, "delta": delta, "sigma": sigma, "epochs": epochs, "batch_size": batch_size,
                  "clip": clip, "lr": lr, "optimizer": value(optimizer), "noise": value(noise),
                  "accountant": value(accountant), "momentum": momentum},
        "model": _model_cli(value(arch), None, activation=value(activation)),
        "seed": seed,
        "recipe": recipe.value,
    }
    report = stage_audit(cli, config, ticket, data_dir, device, plan, progress, noise_seed=noise_seed)
    result = report["audit"]
    if report["warning"]:  # as `dpltm train` says it: a same-data ticket makes the run NOT end-to-end DP
        err_console.print(report["warning"], markup=False, highlight=False)
    if json_out:
        emit_json({**result, "test_accuracy": report["test_accuracy"], "noise_multiplier": report["noise_multiplier"],
                   "sample_rate": report["sample_rate"], "steps": report["steps"], "dataset": report["dataset"],
                   "end_to_end_dp": report["end_to_end_dp"], "epsilon_scope": report["epsilon_scope"],
                   "warning": report["warning"]})
        return
    from dpltm.privacy.display import format_epsilon, round_down

    verdict = (f"REFUTED: the lower bound exceeds the claim; the mechanism that ran is likely not the one accounted "
               f"(a correct one is refuted with probability ≤ {1 - result['confidence']:.0%})"
               if result["refuted"] else "consistent: the attack does not refute the claim")
    err_console.print(f"audit ({result['threat_model']}, {result['canaries']} canaries, {result['observed']}): "
                      f"ε ≥ {round_down(result['epsilon_lower_bound'], 3)} at {result['confidence']:.0%} confidence; "
                      f"claimed ε = {format_epsilon(result['epsilon_claimed'])} (training mechanism; "
                      "scope of the run's ε: "
                      f"{report['epsilon_scope']}); {verdict}")


@app.command()
@user_errors
def account(
    q: opt.AccountQ = None,
    sigma: opt.AccountSigma = None,
    steps: opt.AccountSteps = None,
    delta: opt.AccountDelta = 1e-5,
    dataset_size: opt.AccountDatasetSize = None,
    batch_size: opt.AccountBatchSize = None,
    epochs: opt.AccountEpochs = None,
    eps: opt.AccountEps = None,
    eps1: opt.AccountEps1 = None,
    noise: opt.AccountNoise = Noise.gaussian,
    neighbouring: opt.NeighbouringOption = None,
    json_out: opt.Json = False,
) -> None:
    """ε of Poisson-subsampled Gaussian DP-SGD by each accountant, side by side (or σ for a target ε)."""
    from dpltm.accounting_report import account_report, print_account_report

    relation = (neighbouring or Neighbouring.add_remove).relation
    report = account_report(q=q, sigma=sigma, steps=steps, delta=delta, dataset_size=dataset_size,
                            batch_size=batch_size, epochs=epochs, eps=eps, eps1=eps1, noise=value(noise),
                            neighboring=relation)
    if json_out:
        emit_json(report)
    else:
        print_account_report(report, out_console)


@app.command()
@user_errors
def run(
    dataset: opt.RunDataset = Dataset.mnist,
    public_dataset: opt.RunPublicDataset = Dataset.kmnist,
    public_split: opt.RunPublicSplit = Split.test,
    eps: opt.RunEps = 1.0,
    delta: opt.RunDelta = 1e-5,
    epochs: opt.RunEpochs = None,
    batch_size: opt.RunBatchSize = None,
    clip: opt.Clip = None,
    lr: opt.LearningRate = None,
    neighbouring: opt.NeighbouringOption = None,
    rounds: opt.RunRounds = None,
    iterations: opt.RunIterations = None,
    project_to: opt.RunProjectTo = None,
    activation: opt.RunActivation = None,
    arch: opt.ArchOption = None,
    momentum: opt.RunMomentum = None,
    ema: opt.RunEma = None,
    recipe: opt.RunRecipeOption = RunRecipe.auto,
    tickets: opt.RunTickets = TicketSource.public,
    warmup_epochs: opt.RunWarmupEpochs = None,
    density: opt.RunDensity = None,
    choice: opt.RunChoice = TicketChoice.noise_aware,
    seed: opt.RunSeed = None,
    device: opt.Device = "auto",
    cuda_graphs: opt.CudaGraphs = False,
    config: opt.ConfigFile = None,
    data_dir: opt.DataDir = None,
    download: opt.Download = False,
    out: opt.RunOut = None,
    overwrite: opt.RunOverwrite = False,
    progress: opt.RunProgress = True,
    logger: opt.LoggerOption = Logger.csv,
    log_dir: opt.LogDir = None,
    json_out: opt.Json = False,
) -> None:
    """All stages in a sound (end-to-end DP) mode: public tickets → noise-aware choice → DP training, or
    with --ticket-source private a ticket made on the private data by DP warm-up → DP training."""
    from dpltm.stages.run import RunRequest, stage_run

    check_logger(value(logger))
    request = RunRequest(
        dataset=value(dataset), public_dataset=value(public_dataset), public_split=value(public_split), eps=eps,
        delta=delta, epochs=epochs, batch_size=batch_size, clip=clip, lr=lr,
        neighboring=neighbouring.relation if neighbouring is not None else None, rounds=rounds,
        iterations=iterations, project_to=project_to, activation=value(activation), arch=value(arch),
        momentum=momentum, ema=ema, recipe=value(recipe), ticket_source=tickets, warmup_epochs=warmup_epochs,
        density=density, choice=choice, seed=seed, device=device, cuda_graphs=cuda_graphs, config=config,
        data_dir=data_dir, download=download, out=out, overwrite=overwrite, progress=progress,
        logger=value(logger), log_dir=log_dir)
    finish_training_report(stage_run(request), json_out)


def main() -> None:
    """Entry point: the parser's own usage errors become one line too; SIGINT and SIGTERM stop a
    run cleanly with one line and exit 130 / 143."""
    from typer.exceptions import Abort, TyperException

    _UNWINDING.clear()
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = app(standalone_mode=False)  # returns typer.Exit's code instead of exiting
    except Abort:
        typer.echo("dpltm: interrupted", err=True)
        raise SystemExit(130) from None
    except TyperException as exc:  # usage errors: bad option, bad value, missing argument
        message = " ".join(exc.format_message().split()).replace("Value error, ", "")  # typer's enum wording
        if not message:  # `dpltm` alone: the help was printed, there is no error to add
            raise SystemExit(0) from None
        typer.echo(f"dpltm: error: {one_line(message)}", err=True)
        raise SystemExit(max(int(getattr(exc, "exit_code", 2)), 2)) from None
    finally:  # main() may run inside another program (tests): leave its handlers as they were,
        # except after a signal, when the process is about to exit 128 + signum: a second Ctrl-C
        # must not kill it with the default handler on the way out
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if _UNWINDING else handler)
    if isinstance(code, int) and code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
