"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

from typing import Annotated

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
from dpltm.cli_runtime import emit_json, run_app, user_errors
from dpltm.cli_views import (
    show_audit,
    show_export,
    show_predictions,
    show_private_ticket,
    show_tickets,
    show_training,
    show_winner,
)
from dpltm.console import err_console, out_console
from dpltm.stages.requests import AuditRequest, GenerateRequest, SelectRequest, TrainRequest
from dpltm.stages.select import TicketChoice, TicketSource

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
    rewind_step: opt.GenerateRewindStep = None,
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
    body, target = GenerateRequest.from_options(dict(locals())).run()
    (show_private_ticket if private else show_tickets)(body, target, json_out)


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
    show_predictions(report, json_out)


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
    show_export(exported, model, json_out)


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
    rule: opt.SelectRuleOption = None,
    best: opt.SelectBest = False,
    noise_aware: opt.SelectNoiseAware = False,
    halving: opt.SelectHalving = None,
    search: opt.SelectSearch = None,
    private_size: opt.SelectPrivateSize = None,
    eps2: opt.SelectEps2 = None,
    sigma: opt.SelectSigma = None,
    epochs: opt.SelectEpochs = None,
    batch_size: opt.SelectBatchSize = None,
    device: opt.SelectDevice = None,
    data_dir: opt.SelectDataDir = None,
    reselect: opt.SelectReselect = False,
    seed: opt.SelectSeed = None,
    config: opt.ConfigFile = None,
    out: opt.SelectOut = None,
    overwrite: opt.SelectOverwrite = False,
    progress: opt.SelectProgress = True,
    json_out: opt.Json = False,
) -> None:
    """Phase 2: choose the winning ticket with the exponential mechanism (or --best)."""
    winner, target = SelectRequest.from_options(dict(locals())).run()
    show_winner(winner, target, json_out)


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
    ema_warmup: opt.TrainEmaWarmup = None,
    rewind: opt.TrainRewind = None,
    output_layer: opt.TrainOutputLayer = None,
    freeze: opt.TrainFreeze = None,
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
    public_split: opt.TrainPublicSplit = None,
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
    show_training(TrainRequest.from_options(dict(locals())).run(), json_out)


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
    show_audit(AuditRequest.from_options(dict(locals())).run(), json_out)


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
    ctx: typer.Context,
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
    ema_warmup: opt.RunEmaWarmup = None,
    rewind: opt.RunRewind = None,
    output_layer: opt.RunOutputLayer = None,
    freeze: opt.RunFreeze = None,
    recipe: opt.RunRecipeOption = RunRecipe.auto,
    ticket_source: opt.RunTickets = TicketSource.public,
    warmup_epochs: opt.RunWarmupEpochs = None,
    density: opt.RunDensity = None,
    choice: opt.RunChoice = TicketChoice.noise_aware,
    halving: opt.RunHalving = None,
    search: opt.RunSearch = None,
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

    options = dict(locals())
    sources = {name: getattr(ctx.get_parameter_source(name), "name", None)
               for name in ("public_dataset", "public_split")}
    options["public_given"] = tuple(f"--{name.replace('_', '-')}" for name, source in sources.items()
                                    if source == "COMMANDLINE")  # given, not defaulted
    request = RunRequest.from_options(options)
    show_training(stage_run(request), json_out)


def main() -> None:
    """Entry point (`dpltm`): usage errors and user mistakes as one line, signals as 128 + signum."""
    run_app(app)


if __name__ == "__main__":
    from dpltm.cli_runtime import exit_without_teardown

    main()
    exit_without_teardown()
