"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from dpltm.choices import (
    Accountant,
    Activation,
    Arch,
    Dataset,
    Logger,
    Neighbouring,
    Noise,
    Optimizer,
    Part,
    Rewind,
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
MAX_SEED = 2**63 - 1  # seeds fit torch's and numpy's generators (config.MAX_SEED, without importing torch)


@functools.cache
def _defaults_yaml() -> dict[str, Any]:
    """configs/defaults.yaml, read without importing the config machinery (it loads torch)."""
    from importlib import resources

    import yaml

    return yaml.safe_load((resources.files("dpltm.configs") / "defaults.yaml").read_text("utf-8")) or {}


def cfg(dotted: str, shown: str | None = None) -> str:
    """The effective default of an option that falls through to the config, for `--help`:
    defaults.yaml's value, marked as the config's (a dataset's yaml or --config may override it)."""
    if shown is None:
        node: Any = _defaults_yaml()
        for part in dotted.split("."):
            node = node[part]
        shown = "none" if node is None else ",".join(map(str, node)) if isinstance(node, list) else str(node)
    return f"{shown} from config"


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


DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data root (else $DPLTM_DATA_DIR, else ../shared/data).")]
Download = Annotated[bool, typer.Option("--download", help="First fetch missing official files of the datasets used into the data root: mnist, fashion-mnist and kmnist, md5-checked, through torchvision's dataset classes (pip install 'dpltm\\[download]'); har, isolet and digits must already be there.")]
ConfigFile = Annotated[Path | None, typer.Option("--config", help="YAML file overriding configs/defaults.yaml.")]
class Recipe(str, Enum):
    paper = "paper"
    tuned = "tuned"


class RunRecipe(str, Enum):
    auto = "auto"
    paper = "paper"
    tuned = "tuned"


Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
ArchOption = Annotated[Arch | None, typer.Option("--arch", help="Network: mlp (LeNet-300-100 by default; the paper's) or lenet5 (two 5×5 convolutions with 6 and 16 maps, each followed by the activation and 2×2 average pooling, then --hidden, default 120,84; masks on convolution and linear weights; 28×28 images).", show_default="mlp")]
ActivationOption = Annotated[Activation | None, typer.Option(help="Hidden activation: relu (paper) or tanh (bounded; helps under DP, Papernot et al. 2021).", show_default=cfg("model.activation"))]
SplitOption = Annotated[Split | None, typer.Option(help="Official split to draw from (train: the official training portion, the official test set as test set; test/all: a per-record 80/20 split of that pool).", show_default=cfg("data.split"))]
ValFraction = Annotated[float | None, typer.Option(help="Fraction of the training pool held out for validation.", show_default=cfg("data.val_fraction"))]
# Options `train` and `audit` share: one definition, one help text.
PrivateDataset = Annotated[Dataset | None, typer.Option(help="Private dataset to train on (or the --config file's data.dataset).", show_default="mnist")]
Sigma = Annotated[float | None, typer.Option(help="Noise multiplier σ (skips calibration; ε is reported).")]
DeltaOption = Annotated[float | None, typer.Option(help="δ (paper: 1e-5).", show_default=cfg("train.delta"))]
Epochs = Annotated[int | None, typer.Option(help="Epochs (paper: 50).", show_default=cfg("train.epochs"))]
BatchSize = Annotated[int | None, typer.Option(help="Expected batch size L (Poisson sampling, q = L/N).", show_default=cfg("train.batch_size"))]
Clip = Annotated[float | None, typer.Option(help="Per-sample clipping norm C (paper: 1).", show_default=cfg("train.clip"))]
LearningRate = Annotated[float | None, typer.Option(help="Learning rate (paper: 0.1).", show_default=cfg("train.lr"))]
OptimizerOption = Annotated[Optimizer | None, typer.Option(help="sgd, or adam (NoisyAdam).", show_default=cfg("train.optimizer"))]
Momentum = Annotated[float | None, typer.Option(help="SGD momentum on the privatized gradients, in [0, 1).", show_default=cfg("train.momentum"))]
NoiseOption = Annotated[Noise | None, typer.Option(help="Noise plug-in: gaussian, dpd (differentially private dropout; --sigma is its σ, accounted as 2σ) or shaped (needs --public-dataset).", show_default=cfg("train.noise"))]
AccountantOption = Annotated[Accountant | None, typer.Option(help="Privacy accountant: pld (tight numerical) or rdp.", show_default=cfg("train.accountant"))]
NeighbouringOption = Annotated[Neighbouring | None, typer.Option("--neighbouring", "--neighboring", help="Neighbouring datasets ε is stated for: add-remove (one record added or removed; the number of training records N is treated as public, as Opacus and TF Privacy do) or replace-one (one record replaced, N fixed; a larger ε for the same run).", show_default="add-remove")]
Seed = Annotated[int | None, typer.Option(help="Seed for the data split and any fresh layer.", show_default=cfg("seed"))]


def _model_cli(arch: str | None, hidden: str | None, **rest: Any) -> dict[str, Any]:
    """The `model:` part of a command's settings (dpltm.architectures.model_cli)."""
    from dpltm.architectures import model_cli

    return model_cli(arch, _ints(hidden, "--hidden"), **rest)


Json = Annotated[bool, typer.Option("--json", help="Print the final report as one JSON object on stdout.")]
LoggerOption = Annotated[Logger, typer.Option("--logger", help="Lightning logger of the run's versioned folder (<log-dir>/<command>/<dataset>/version_N): csv, tensorboard (pip install 'dpltm\\[tensorboard]'), mlflow (pip install 'dpltm\\[mlflow]'; $MLFLOW_TRACKING_URI, else <log-dir>/mlflow.db) or none (run.json only, which `dpltm plot` reads).")]
LogDir = Annotated[Path | None, typer.Option("--log-dir", help="Root of the run folders (else $DPLTM_LOG_DIR, else ./logs).")]
CudaGraphs = Annotated[bool, typer.Option("--cuda-graphs", help="Replay each training step from CUDA graphs (one CUDA device): the same batches and updates without per-step kernel launches; DP batches are padded to a fixed capacity with zero-weight rows (overflow in extra chunks, noise once per step): the same mechanism.")]


@app.command()
@user_errors
def generate(
    dataset: Annotated[Dataset | None, typer.Option(help="Dataset the tickets are made on.", show_default=cfg("data.dataset"))] = None,
    split: SplitOption = None,
    rounds: Annotated[int | None, typer.Option(help="Pruning rounds T (ticket 0 is the dense network).", show_default=cfg("generate.rounds"))] = None,
    iterations: Annotated[int | None, typer.Option(help="SGD iterations per ticket (paper: 5000).", show_default=cfg("generate.iterations"))] = None,
    batch_size: Annotated[int | None, typer.Option(help="Mini-batch size (paper: 400).", show_default=cfg("generate.batch_size"))] = None,
    lr: Annotated[float | None, typer.Option(help="SGD learning rate (paper: 0.1).", show_default=cfg("generate.lr"))] = None,
    prune_rates: Annotated[str | None, typer.Option(help="Fraction of survivors pruned per round: one value, or one per layer (paper: 0.3,0.3,0.2).", show_default=cfg("", "0.3 per layer, 0.2 for the output layer"))] = None,
    min_density: Annotated[float | None, typer.Option(help="Stop before a ticket would keep less than this fraction of weights.", show_default=cfg("generate.min_density"))] = None,
    hidden: Annotated[str | None, typer.Option(help="Hidden layer widths (paper: 300,100).", show_default=cfg("model.hidden"))] = None,
    arch: ArchOption = None,
    project_to: Annotated[int | None, typer.Option("--project-to", help="Add an input projection layer to this width (paper §4.5.2 transfer).")] = None,
    activation: ActivationOption = None,
    controls: Annotated[bool | None, typer.Option("--controls/--no-controls", help="Also train the random-reinit and random-mask control tickets.", show_default=cfg("generate.controls"))] = None,
    val_fraction: ValFraction = None,
    seed: Annotated[int | None, typer.Option(help="Seed for θ0, data split and batch order.", show_default=cfg("seed"))] = None,
    private: Annotated[bool, typer.Option("--private", help="Make ONE ticket on the private data itself, with privacy: DP-SGD warm-up (the train: recipe), masks by magnitude of the DP weights, one σ calibrated so warm-up + the planned training meet --eps. Writes a ticket for `dpltm train --ticket` (no select).")] = False,
    eps: Annotated[float | None, typer.Option("--eps", "--eps2", help="With --private: ε of the whole run (warm-up and training, composed by PLD).", show_default=cfg("train.eps2"))] = None,
    delta: Annotated[float | None, typer.Option(help="With --private: δ.", show_default=cfg("train.delta"))] = None,
    warmup_epochs: Annotated[int | None, typer.Option(help="With --private: DP-SGD epochs per warm-up round.", show_default=cfg("private_ticket.warmup_epochs"))] = None,
    density: Annotated[float | None, typer.Option(help="With --private: fraction of weights the ticket keeps.", show_default=cfg("private_ticket.density"))] = None,
    rewind: Annotated[Rewind | None, typer.Option(help="With --private: train from the masked warm-up weights (warmup) or from θ0 (init).", show_default=cfg("private_ticket.rewind"))] = None,
    epochs: Annotated[int | None, typer.Option(help="With --private: epochs of the ticket's DP training, planned now (σ covers them).", show_default=cfg("train.epochs"))] = None,
    noise_seed: Annotated[int | None, typer.Option("--noise-seed", min=0, max=MAX_SEED, help="With --private: seed the noise and Poisson sampling (reproducible; DP only while the seed stays secret). Default: a fresh OS-CSPRNG seed, never stored.")] = None,
    device: Device = "auto",
    cuda_graphs: CudaGraphs = False,
    config: ConfigFile = None,
    data_dir: DataDir = None,
    download: Download = False,
    out: Annotated[Path | None, typer.Option(help="Ticket file (default checkpoints/<dataset>-tickets.pt; with --private <dataset>-private-ticket.pt).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing ticket file made with other settings.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    logger: LoggerOption = Logger.csv,
    log_dir: LogDir = None,
    json_out: Json = False,
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
            raise DpltmUserError(f"--private makes MLP tickets; --arch {arch} is for public tickets (without --private)")
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
            err_console.print(f"train it with: dpltm train --ticket {target} --dataset {ticket['source']['data']['dataset']}"
                              f" (σ is calibrated so the whole run meets ε = {ticket['private_ticket']['epsilon_total']:g})")
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
    path: Annotated[Path, typer.Argument(help="A ticket file (`dpltm generate`), a winner (`dpltm select`), a model (`dpltm train`), its export (.safetensors) or a library run (`make_private(...).save`).")],
    json_out: Json = False,
) -> None:
    """Show a dpltm file as tables: a ticket set's C per layer and accuracies; a winner's ticket and
    selection; a model's accuracy, ledger and privacy statement (recomputed from the ledger it
    carries); a library run's spent segments, epochs and statement."""
    from dpltm.checkpoint import load_checkpoint
    from dpltm.data.release import PRIVATE_FINGERPRINT_WARNING, carries_private_fingerprint
    from dpltm.export import SUFFIX, private_fingerprints, read_metadata
    from dpltm.report import (
        print_export,
        print_model,
        print_run,
        print_tickets,
        print_winner,
        run_summary,
        tickets_json,
    )

    def warn_if(found: list[str]) -> None:  # files written before dpltm.data.release's rule
        if found:
            err_console.print(f"warning: {path} {PRIVATE_FINGERPRINT_WARNING} ({', '.join(found)}); "
                              "`dpltm export` drops it", markup=False, highlight=False)

    if path.suffix == SUFFIX:
        metadata = read_metadata(path)
        exported = {"kind": "export", **{k: (v if k in ("privacy_statement", "source_checkpoint", "format")
                                               else json.loads(v)) for k, v in metadata.items()}}
        warn_if(["data"] if carries_private_fingerprint(exported.get("data")) else [])
        if json_out:
            emit_json(exported)
            return
        print_export(exported, out_console)
        return
    body = load_checkpoint(path, ("tickets", "ticket", "model", "run"))
    if body["kind"] == "tickets":
        if json_out:
            emit_json(tickets_json(body))
        else:
            print_tickets(body, out_console)
        return
    if body["kind"] == "ticket":
        private_ticket = body["selection"].get("method") == "private"
        warn_if(["source.data"] if private_ticket and carries_private_fingerprint(body["source"]["data"]) else [])
        summary = {"kind": "winner", "round": body["round"], "density": body["density"],
                   "layer_density": body["layer_density"], "val_accuracy": body["val_accuracy"],
                   "selection": body["selection"], "source": body["source"]["data"], "privacy": body["privacy"],
                   "architecture": body["architecture"], "dpltm_version": body.get("dpltm_version"),
                   "environment": body.get("environment")}
    elif body["kind"] == "run":
        summary = run_summary(body)
    else:
        from dpltm.privacy.ledger import PrivacyLedger

        warn_if(private_fingerprints(body))
        ledger = PrivacyLedger.from_json(body["ledger"])
        report = body["report"]
        summary = {"kind": "model", "architecture": body["architecture"], "dataset": report.get("dataset"),
                   "test_accuracy": report.get("test_accuracy"), "val_accuracy": report.get("val_accuracy"),
                   "epochs_run": report.get("epochs_run"), "steps": report.get("steps"),
                   "released_weights": report.get("released_weights"), "ticket": body.get("ticket"),
                   "ledger": ledger.report(), "statement": ledger.statement(),
                   "dpltm_version": body.get("dpltm_version"), "environment": body.get("environment")}
    if json_out:
        emit_json(summary)
        return
    {"winner": print_winner, "model": print_model, "run": print_run}[summary["kind"]](summary, out_console)



@app.command()
@user_errors
def predict(
    model: Annotated[Path, typer.Option(help="A model: a `dpltm train` checkpoint or its `dpltm export` (.safetensors).")],
    dataset: Annotated[Dataset | None, typer.Option(help="Dataset to predict on.", show_default="the one the model was trained on")] = None,
    split: Annotated[Split | None, typer.Option(help="Official split to draw from, as in training (train: the official test set is the test set; test/all: a per-record 80/20 split of that pool).", show_default="the model's own on its training dataset, else train")] = None,
    part: Annotated[Part, typer.Option(help="Which records: the test set, the validation hold-out or the training set (with the model's own data settings when the dataset is its training dataset).")] = Part.test,
    device: Device = "auto",
    data_dir: DataDir = None,
    download: Download = False,
    out: Annotated[Path | None, typer.Option(help="Write the predictions here as CSV: index, label, prediction and one probability per class.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out file.")] = False,
    expose_training_records: Annotated[bool, typer.Option("--expose-training-records", help="Allow --part train on the model's own dataset: its output holds per-record labels and model outputs of the private training records, which are not differentially private.")] = False,
    json_out: Json = False,
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
    model: Annotated[Path, typer.Option(help="A `dpltm train` checkpoint, or a library run saved by `PrivateTraining.save`.")],
    out: Annotated[Path | None, typer.Option(help="The safetensors file.", show_default="the model's path with .safetensors")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing file.")] = False,
    json_out: Json = False,
) -> None:
    """Write a trained model as safetensors: weights (pruned ones exactly 0), masks, input
    normalisation, data settings, and the privacy statement and ledger as metadata."""
    from dpltm.checkpoint import prepare_output
    from dpltm.export import SUFFIX, export_model

    target = out or model.with_suffix(SUFFIX)
    if target.suffix != SUFFIX:
        raise DpltmUserError(f"--out {target}: an export is a {SUFFIX} file")
    prepare_output(target, overwrite=overwrite, inputs=[model])
    metadata = export_model(model, target, warn=lambda line: err_console.print(line, markup=False, highlight=False))
    privacy = json.loads(metadata["privacy"])
    if json_out:
        emit_json({"output": str(target), "privacy": privacy, "architecture": json.loads(metadata["architecture"]),
                   "input_normalisation": json.loads(metadata["input_normalisation"])})
        return
    err_console.print(f"exported {model} to {target}")
    err_console.print(metadata["privacy_statement"], markup=False, highlight=False)


@app.command()
@user_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run folders (logs/<command>/<dataset>/version_N) or their run.json; several overlay.")],
    out: Annotated[Path | None, typer.Option(help="Figure file (.png, .pdf or .svg).", show_default="plot.png in the first run's folder")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out file.")] = False,
) -> None:
    """Draw a run's curves: accuracy and ε spent per epoch (train), or accuracy against the
    fraction of weights left (generate)."""
    from dpltm.plotting import plot_runs

    written = plot_runs(runs, out, overwrite)
    err_console.print(f"figure: {written}")


@app.command()
@user_errors
def download(
    datasets: Annotated[list[Dataset], typer.Argument(help="Datasets to fetch (mnist, fashion-mnist, kmnist: through torchvision's dataset classes).")],
    data_dir: DataDir = None,
    mirror: Annotated[str | None, typer.Option(help="URL base to fetch the official files from instead of torchvision's mirrors (else $DPLTM_DOWNLOAD_MIRROR).")] = None,
) -> None:
    """Fetch the official files into the data root, md5-checked (what --download does before a run)."""
    from dpltm.data.download import download_dataset

    for name in datasets:
        err_console.print(download_dataset(value(name), data_dir, mirror=mirror).summary())


@app.command()
@user_errors
def select(
    tickets: Annotated[Path | None, typer.Option(help="Ticket set (default: the newest in checkpoints/, named on screen).")] = None,
    eps1: Annotated[float | None, typer.Option(help="Selection budget ε1 (paper: 0.1).", show_default=cfg("select.eps1"))] = None,
    nu: Annotated[float | None, typer.Option(help="Score weight ν in S = A·(1 − ν·C) (paper: 50).", show_default=cfg("select.nu"))] = None,
    best: Annotated[bool, typer.Option("--best", help="Pick the best paper score S = A·(1 − ν·C) without privacy (for tickets from public data). Beware: at ν = 50 the factor is negative for every C > 0.02, so it always takes the sparsest ticket, whatever the noise; prefer --noise-aware.")] = False,
    noise_aware: Annotated[bool, typer.Option("--noise-aware", help="Train every ticket (the dense network included) under the planned DP noise on the tickets' own public data and pick the best; spends no ε. Needs --private-size; the planned run is --eps/--sigma, --epochs, --batch-size and the config's train section.")] = False,
    private_size: Annotated[int | None, typer.Option("--private-size", help="N, the private training set's size (public), for --noise-aware's planned run.")] = None,
    eps2: Annotated[float | None, typer.Option("--eps", "--eps2", help="--noise-aware: the planned training budget ε2 (σ calibrated to it).", show_default=cfg("train.eps2"))] = None,
    sigma: Annotated[float | None, typer.Option(help="--noise-aware: the planned noise multiplier instead of --eps.")] = None,
    epochs: Annotated[int | None, typer.Option(help="--noise-aware: the planned epochs.", show_default=cfg("train.epochs"))] = None,
    batch_size: Annotated[int | None, typer.Option(help="--noise-aware: the planned expected batch size L.", show_default=cfg("train.batch_size"))] = None,
    device: Device = "auto",
    data_dir: DataDir = None,
    reselect: Annotated[bool, typer.Option("--reselect", help="Allow another exponential-mechanism draw from a ticket set already drawn from; the winner's ledger composes every draw.")] = False,
    seed: Annotated[int | None, typer.Option(min=0, max=MAX_SEED, help="Seed the draw (reproducible, not secret); default: OS CSPRNG.")] = None,
    config: ConfigFile = None,
    out: Annotated[Path | None, typer.Option(help="Winner file (default checkpoints/<dataset>-winner.pt).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing winner file.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    json_out: Json = False,
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
    ticket: Annotated[Path | None, typer.Option(help="Winning ticket from `dpltm select`.")] = None,
    dataset: PrivateDataset = None,
    split: SplitOption = None,
    eps2: Annotated[float | None, typer.Option("--eps", "--eps2", help="Training budget ε (the paper's ε2); σ is calibrated to it. With a private ticket (generate --private): the whole run's ε, warm-up included (default: the ε the ticket was planned for).", show_default=cfg("train.eps2"))] = None,
    delta: DeltaOption = None,
    sigma: Sigma = None,
    epochs: Epochs = None,
    batch_size: BatchSize = None,
    clip: Clip = None,
    lr: LearningRate = None,
    recipe: Annotated[Recipe, typer.Option(help="Training recipe under --config and flags: paper (defaults.yaml; the default) or tuned (chosen on public data for MNIST-sized sets: tanh, L = 1600, lr = 6/σ, EMA 0.999; configs/recipes/tuned.yaml).")] = Recipe.paper,
    lr_sigma: Annotated[float | None, typer.Option("--lr-sigma", help="Set a DP run's learning rate to this / σ, so an update's noise stays the same across budgets (the tuned recipe's rule; overrides --lr for DP runs).")] = None,
    optimizer: OptimizerOption = None,
    momentum: Momentum = None,
    ema: Annotated[float | None, typer.Option("--ema", metavar="DECAY", help="Release and evaluate an exponential moving average of the iterates with this decay, e.g. 0.999 (post-processing: free). Default: the final iterate.")] = None,
    activation: Annotated[Activation | None, typer.Option(help="Activation of the network trained (a ticket's included): relu (paper) or tanh (bounded; helps under DP, Papernot et al. 2021).", show_default=cfg("model.activation"))] = None,
    arch: ArchOption = None,
    noise: NoiseOption = None,
    accountant: AccountantOption = None,
    neighbouring: NeighbouringOption = None,
    max_eps: Annotated[float | None, typer.Option("--max-eps", help="A cap: stop before the ε spent would exceed this (σ stays calibrated to --eps).")] = None,
    target_eps: Annotated[float | None, typer.Option("--target-eps", hidden=True)] = None,
    patience: Annotated[int | None, typer.Option(help="Early-stop after this many epochs without validation gain.")] = None,
    dense: Annotated[bool, typer.Option("--dense", help="DP-SGD baseline on the full network (no ticket).")] = False,
    non_private: Annotated[bool, typer.Option("--non-private", help="Train without privacy (baseline).")] = False,
    public_tickets: Annotated[bool, typer.Option("--public-tickets", help="Assert the ticket's generation data is public even though it has the private dataset's name (checked record by record).")] = False,
    val_fraction: ValFraction = None,
    public_dataset: Annotated[Dataset | None, typer.Option(help="Public dataset for noise plug-ins that need one (shaped); never the private dataset.")] = None,
    public_split: Annotated[Split, typer.Option(help="Split of --public-dataset whose training part is used.")] = Split.train,
    public_data: Annotated[str | None, typer.Option("--public-data", hidden=True)] = None,
    seed: Seed = None,
    noise_seed: Annotated[int | None, typer.Option("--noise-seed", min=0, max=MAX_SEED, help="Seed the noise and Poisson sampling (reproducible; DP only while the seed stays secret). Default: a fresh OS-CSPRNG seed, never stored.")] = None,
    device: Device = "auto",
    devices: Annotated[int, typer.Option(help="DP training on this many devices per node (Lightning DDP: one process each; on CPU, gloo processes). Each rank Poisson-samples its shard of the records, the clipped sums are all-reduced and the noise is added once: the same mechanism and ε as on one device.")] = 1,
    num_nodes: Annotated[int, typer.Option("--num-nodes", help="Nodes of a multi-device run (launch one command per node with NODE_RANK, MASTER_ADDR and MASTER_PORT set, as Lightning documents).")] = 1,
    strategy: Annotated[Strategy, typer.Option(help="auto, or ddp (what auto picks for more than one process).")] = Strategy.auto,
    cuda_graphs: CudaGraphs = False,
    config: ConfigFile = None,
    data_dir: DataDir = None,
    download: Download = False,
    out: Annotated[Path | None, typer.Option(help="Model checkpoint (default checkpoints/<dataset>-<mode>.pt).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model file.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    logger: LoggerOption = Logger.csv,
    log_dir: LogDir = None,
    json_out: Json = False,
) -> None:
    """Phase 3: DP-SGD on the masked winner (or --dense / --non-private baselines)."""
    check_logger(value(logger))
    renamed = {"--target-eps": (target_eps, "--max-eps (a cap: stop before spending more; σ is calibrated to --eps)"),
               "--public-data": (public_data, "--public-dataset NAME with --public-split SPLIT")}
    for old, (given, new) in renamed.items():
        if given is not None:
            raise DpltmUserError(f"{old} was renamed {new}")
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
                  "clip": clip, "lr": lr, "lr_sigma": lr_sigma, "optimizer": optimizer, "noise": noise, "accountant": accountant,
                  "neighboring": neighbouring.relation if neighbouring is not None else None, "max_eps": max_eps, "patience": patience, "momentum": momentum, "ema": ema},
        "model": _model_cli(arch, None, activation=activation),
        "seed": seed,
        "recipe": recipe.value,
    }
    from dpltm.dp.distributed import Distribution

    distribution = Distribution(devices, num_nodes, value(strategy))
    report = stage_train(cli, config, ticket, non_private, public_tickets, data_dir, device, out, progress,
                         public_data=None if public_dataset is None else f"{value(public_dataset)}:{value(public_split)}",
                         noise_seed=noise_seed, overwrite=overwrite,
                         distribution=distribution, cuda_graphs=cuda_graphs, logger=value(logger), log_dir=log_dir,
                         download=download)
    finish_training_report(report, json_out)


@app.command()
@user_errors
def audit(
    ticket: Annotated[Path | None, typer.Option(help="Winning ticket from `dpltm select` (as for `dpltm train`).")] = None,
    dense: Annotated[bool, typer.Option("--dense", help="Audit DP-SGD on the full network (no ticket).")] = False,
    dataset: PrivateDataset = None,
    split: SplitOption = None,
    eps2: Annotated[float | None, typer.Option("--eps", "--eps2", help="Training budget ε; σ is calibrated to it (the claim the audit tests).", show_default=cfg("train.eps2"))] = None,
    sigma: Sigma = None,
    delta: DeltaOption = None,
    epochs: Epochs = None,
    batch_size: BatchSize = None,
    clip: Clip = None,
    lr: LearningRate = None,
    recipe: Annotated[Recipe, typer.Option(help="Training recipe, as for `dpltm train`.")] = Recipe.paper,
    optimizer: OptimizerOption = None,
    momentum: Momentum = None,
    activation: ActivationOption = None,
    arch: ArchOption = None,
    noise: NoiseOption = None,
    accountant: AccountantOption = None,
    canaries: Annotated[int, typer.Option(help="Number m of canaries, each included with probability 1/2.")] = 1000,
    threat_model: Annotated[ThreatModel, typer.Option(help="white-box: Dirac gradient canaries on surviving weights, observed through the released noisy gradients (also reported: the final model only); black-box: out-of-distribution input records with random labels, scored by the released model's loss.")] = ThreatModel.white_box,
    confidence: Annotated[float, typer.Option(help="Confidence of the lower bound.")] = 0.95,
    canary_seed: Annotated[int | None, typer.Option(min=0, max=MAX_SEED, help="Seed the canaries and their inclusion bits (reproducible audits). Default: fresh OS randomness.")] = None,
    seed: Seed = None,
    noise_seed: Annotated[int | None, typer.Option("--noise-seed", min=0, max=MAX_SEED, help="Seed the noise and Poisson sampling. Default: a fresh OS-CSPRNG seed.")] = None,
    device: Device = "auto",
    config: ConfigFile = None,
    data_dir: DataDir = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    json_out: Json = False,
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
                      f"claimed ε = {format_epsilon(result['epsilon_claimed'])} (training mechanism; scope of the run's ε: "
                      f"{report['epsilon_scope']}); {verdict}")


@app.command()
@user_errors
def account(
    q: Annotated[float | None, typer.Option("--q", help="Poisson sampling rate.")] = None,
    sigma: Annotated[float | None, typer.Option(help="Noise multiplier σ.")] = None,
    steps: Annotated[int | None, typer.Option(help="Number of steps T.")] = None,
    delta: Annotated[float, typer.Option(help="δ.")] = 1e-5,
    dataset_size: Annotated[int | None, typer.Option(help="N (with --batch-size and --epochs instead of --q/--steps).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Expected batch size L.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs (⌈N/L⌉ steps each).")] = None,
    eps: Annotated[float | None, typer.Option("--eps", "--eps2", help="Solve for σ reaching this ε instead.")] = None,
    eps1: Annotated[float | None, typer.Option(help="Also compose with an ε1 exponential-mechanism selection.")] = None,
    noise: Annotated[Noise, typer.Option(help="Noise plug-in --sigma belongs to: gaussian, dpd (accounted as 2σ; adds the DPD paper's own zCDP figure as a labelled comparison) or shaped.")] = Noise.gaussian,
    neighbouring: NeighbouringOption = None,
    json_out: Json = False,
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
    dataset: Annotated[Dataset, typer.Option(help="Private dataset to train on.")] = Dataset.mnist,
    public_dataset: Annotated[Dataset, typer.Option(help="Public dataset the tickets come from.")] = Dataset.kmnist,
    public_split: Annotated[Split, typer.Option(help="Split of the public dataset (KMNIST here: test).")] = Split.test,
    eps: Annotated[float, typer.Option("--eps", "--eps2", help="Privacy budget ε for the private data (all of it goes to training: public tickets cost nothing).")] = 1.0,
    delta: Annotated[float, typer.Option(help="δ.")] = 1e-5,
    epochs: Annotated[int | None, typer.Option(help="DP training epochs (paper: 50).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Expected DP batch size L (paper: 400).")] = None,
    clip: Clip = None,
    lr: LearningRate = None,
    neighbouring: NeighbouringOption = None,
    rounds: Annotated[int | None, typer.Option(help="Pruning rounds (paper-style default: 10).")] = None,
    iterations: Annotated[int | None, typer.Option(help="SGD iterations per ticket (paper: 5000).")] = None,
    project_to: Annotated[int | None, typer.Option("--project-to", help="Input projection width of the tickets (default: added automatically when the two datasets' input sizes differ).")] = None,
    activation: Annotated[Activation | None, typer.Option(help="Hidden activation of the tickets and the trained network: relu (paper) or tanh (bounded; helps under DP, Papernot et al. 2021).", show_default="the recipe's")] = None,
    arch: ArchOption = None,
    momentum: Annotated[float | None, typer.Option(help="SGD momentum on the privatized gradients, in [0, 1).", show_default="the recipe's")] = None,
    ema: Annotated[float | None, typer.Option("--ema", metavar="DECAY", help="Release and evaluate an exponential moving average of the iterates with this decay, e.g. 0.999 (post-processing: free). Default: the final iterate.")] = None,
    recipe: Annotated[RunRecipe, typer.Option(help="Training recipe (under --config and flags): auto (the default: tuned for sets of at least 20000 training records, the size it was chosen for; paper below), tuned (chosen on public data: tanh, L = 1600, lr = 6/σ, EMA 0.999) or paper.")] = RunRecipe.auto,
    tickets: Annotated[TicketSource, typer.Option("--ticket-source", help="Where the ticket comes from: public (generated without privacy on --public-dataset) or private (made on --dataset itself by DP warm-up, no public data needed; warm-up and training composed to --eps).")] = TicketSource.public,
    old_tickets: Annotated[str | None, typer.Option("--tickets", hidden=True)] = None,
    warmup_epochs: Annotated[int | None, typer.Option(help="With --ticket-source private: DP warm-up epochs, taken out of --epochs.", show_default=cfg("private_ticket.warmup_epochs"))] = None,
    density: Annotated[float | None, typer.Option(help="With --ticket-source private: fraction of weights the ticket keeps.", show_default=cfg("private_ticket.density"))] = None,
    choice: Annotated[TicketChoice, typer.Option(help="How to pick the public ticket: noise-aware (train every ticket, the dense network included, under the planned DP noise on the public data; spends no ε) or best (the paper's score, which at ν = 50 always takes the sparsest ticket).")] = TicketChoice.noise_aware,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
    device: Device = "auto",
    cuda_graphs: CudaGraphs = False,
    config: ConfigFile = None,
    data_dir: DataDir = None,
    download: Download = False,
    out: Annotated[Path | None, typer.Option(help="Model checkpoint (default checkpoints/<dataset>-dpltm.pt); the tickets and winner go beside it as <stem>-tickets.pt and <stem>-winner.pt.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing outputs (finished tickets made with the same settings are reused).")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    logger: LoggerOption = Logger.csv,
    log_dir: LogDir = None,
    json_out: Json = False,
) -> None:
    """All stages in a sound (end-to-end DP) mode: public tickets → noise-aware choice → DP training, or
    with --ticket-source private a ticket made on the private data by DP warm-up → DP training."""
    from dpltm.stages.run import RunRequest, stage_run

    check_logger(value(logger))
    if old_tickets is not None:
        raise DpltmUserError(f"`dpltm run --tickets {old_tickets}` was renamed --ticket-source {old_tickets} "
                             "(--tickets names a ticket file, as in `dpltm select --tickets`)")
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
