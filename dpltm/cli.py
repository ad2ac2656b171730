"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from dpltm.errors import DpltmUserError

app = typer.Typer(
    name="dpltm",
    help="Differentially private training by way of lottery tickets (DPLTM).",
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
)
err_console = Console(stderr=True)
out_console = Console()

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn user mistakes into one clear line and a non-zero exit."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DpltmUserError as exc:
            typer.echo(f"dpltm: error: {exc}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("dpltm: interrupted; finished rounds are saved, rerun to resume", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


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


def _strict(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings, as the privacy report does."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def emit_json(report: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(_strict(report), indent=2, default=str, allow_nan=False) + "\n")


DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data root (else $DPLTM_DATA_DIR, else ../shared/data).")]
ConfigFile = Annotated[Path | None, typer.Option("--config", help="YAML file overriding configs/defaults.yaml.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
Json = Annotated[bool, typer.Option("--json", help="Print the final report as one JSON object on stdout.")]


@app.command()
@user_errors
def generate(
    dataset: Annotated[str | None, typer.Option(help="mnist, fashion-mnist, kmnist, har, isolet or digits.")] = None,
    split: Annotated[str | None, typer.Option(help="Official split to draw from: train, test or all.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Pruning rounds T (ticket 0 is the dense network).")] = None,
    iterations: Annotated[int | None, typer.Option(help="SGD iterations per ticket (paper: 5000).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Mini-batch size (paper: 400).")] = None,
    lr: Annotated[float | None, typer.Option(help="SGD learning rate (paper: 0.1).")] = None,
    prune_rates: Annotated[str | None, typer.Option(help="Fraction of survivors pruned per round: one value, or one per layer (paper: 0.3,0.3,0.2).")] = None,
    min_density: Annotated[float | None, typer.Option(help="Stop before a ticket would keep less than this fraction of weights.")] = None,
    hidden: Annotated[str | None, typer.Option(help="Hidden layer widths (paper: 300,100).")] = None,
    project_to: Annotated[int | None, typer.Option("--project-to", help="Add an input projection layer to this width (paper §4.5.2 transfer).")] = None,
    controls: Annotated[bool | None, typer.Option("--controls/--no-controls", help="Also train the random-reinit and random-mask control tickets.")] = None,
    val_fraction: Annotated[float | None, typer.Option(help="Fraction of the training pool held out for validation.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for θ0, data split and batch order.")] = None,
    device: Device = "auto",
    config: ConfigFile = None,
    data_dir: DataDir = None,
    out: Annotated[Path | None, typer.Option(help="Ticket file (default checkpoints/<dataset>-tickets.pt).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing ticket file made with other settings.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    json_out: Json = False,
) -> None:
    """Phase 1: lottery tickets by iterative magnitude pruning (non-private)."""
    from dpltm.report import print_tickets, tickets_json

    cli = {
        "data": {"dataset": dataset, "split": split, "val_fraction": val_fraction},
        "model": {"hidden": _ints(hidden, "--hidden"), "project_to": project_to},
        "generate": {
            "rounds": rounds, "iterations": iterations, "batch_size": batch_size, "lr": lr,
            "prune_rates": _floats(prune_rates, "--prune-rates"), "min_density": min_density,
            "controls": controls,
        },
        "seed": seed,
    }
    payload, target = stage_generate(cli, config, data_dir, device, out, overwrite, progress)
    if json_out:
        emit_json({**tickets_json(payload), "output": str(target)})
    else:
        print_tickets(payload, err_console)
        err_console.print(f"ticket file: {target}")


def stage_generate(cli: dict[str, Any], config: Path | None, data_dir: Path | None, device: str,
                   out: Path | None, overwrite: bool, progress: bool) -> tuple[dict[str, Any], Path]:
    from dpltm.checkpoint import check_writable
    from dpltm.config import resolve_generate_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.lottery import generate_tickets
    from dpltm.paths import default_checkpoint_dir

    cfg = resolve_generate_config(cli, config)
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-tickets.pt"
    check_writable(target)
    torch_device = resolve_device(device)
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    err_console.print(
        f"generating tickets on {data.name} ({data.source_split} split: {len(data.train)} train, "
        f"{len(data.val)} val, {len(data.test)} test) on {torch_device}; "
        f"phase 1 is NOT private: it sees this data directly"
    )

    def on_round(record: dict[str, Any]) -> None:
        err_console.print(
            f"round {record['round']}: C={record['density']:.4f} "
            f"val acc={record['val_accuracy']:.4f} test acc={record['test_accuracy']:.4f}"
        )

    payload = generate_tickets(cfg, data, target, overwrite=overwrite, progress=progress, on_round=on_round)
    return payload, target


@app.command()
@user_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="A ticket file written by `dpltm generate`.")],
    json_out: Json = False,
) -> None:
    """Show the tickets in a ticket file: C per layer, accuracies, and metadata."""
    from dpltm.checkpoint import load_checkpoint
    from dpltm.report import print_tickets, tickets_json

    payload = load_checkpoint(path, "tickets")
    if json_out:
        emit_json(tickets_json(payload))
    else:
        print_tickets(payload, out_console)


def _print_selection(payload: dict[str, Any], selection: Any, eps1: float | None, nu: float) -> None:
    from rich.table import Table

    table = Table(title=f"selection over {len(payload['tickets'])} tickets, S = A·(1 − {nu:g}·C)")
    for column in ("round", "C", "A (val)", "score S", "P(select)"):
        table.add_column(column, justify="right")
    for i, t in enumerate(payload["tickets"]):
        mark = " ←" if i == selection.index else ""
        table.add_row(str(t["round"]), f"{t['density']:.4f}", f"{t['val_accuracy']:.4f}",
                      f"{selection.scores[i]:.4f}", f"{selection.probabilities[i]:.4f}{mark}")
    err_console.print(table)
    if eps1 is None:
        err_console.print("non-private pick (--best): the highest score, no privacy spent on the ticket data.")
        return
    err_console.print(f"exponential mechanism: ε1 = {eps1:g}, sensitivity Δ = {selection.sensitivity:.4g}")
    if selection.near_uniform:
        err_console.print(
            f"[bold]the choice is close to uniform at ε1 = {eps1:g}[/bold] (every probability within 10 % of "
            f"1/{len(payload['tickets'])}); ε1 ≈ {selection.decisive_eps1:.3g} would pick the best ticket "
            f"with probability 0.9"
        )


@app.command()
@user_errors
def select(
    tickets: Annotated[Path | None, typer.Option(help="Ticket set (default: the newest in checkpoints/).")] = None,
    eps1: Annotated[float | None, typer.Option(help="Selection budget ε1 (paper: 0.1).")] = None,
    nu: Annotated[float | None, typer.Option(help="Score weight ν in S = A·(1 − ν·C) (paper: 50).")] = None,
    best: Annotated[bool, typer.Option("--best", help="Pick the best score without privacy (for tickets from public data).")] = False,
    seed: Annotated[int | None, typer.Option(help="Seed the draw (reproducible, not secret); default: OS CSPRNG.")] = None,
    config: ConfigFile = None,
    out: Annotated[Path | None, typer.Option(help="Winner file (default checkpoints/<dataset>-winner.pt).")] = None,
    json_out: Json = False,
) -> None:
    """Phase 2: choose the winning ticket with the exponential mechanism (or --best)."""
    winner, target = stage_select({"select": {"eps1": eps1, "nu": nu}}, config, tickets, best, seed, out)
    if json_out:
        emit_json({"winner_round": winner["round"], "density": winner["density"],
                   "val_accuracy": winner["val_accuracy"], "selection": winner["selection"],
                   "tickets": winner["source"]["tickets"], "output": str(target)})


def stage_select(cli: dict[str, Any], config: Path | None, tickets: Path | None, best: bool,
                 seed: int | None, out: Path | None) -> tuple[dict[str, Any], Path]:
    from dpltm.checkpoint import check_writable, load_checkpoint, save_atomic
    from dpltm.config import resolve_select_config
    from dpltm.paths import default_checkpoint_dir
    from dpltm.selection import choose, newest_ticket_set, winner_payload

    settings = resolve_select_config(cli, config)
    source = tickets or newest_ticket_set(default_checkpoint_dir())
    payload = load_checkpoint(source, "tickets")
    target = out or default_checkpoint_dir() / f"{payload['data']['dataset']}-winner.pt"
    check_writable(target)
    chosen_eps1 = None if best else settings.eps1
    selection = choose(payload, eps1=chosen_eps1, nu=settings.nu, seed=seed)
    winner = winner_payload(payload, source, selection, eps1=chosen_eps1, nu=settings.nu, seeded=seed is not None)
    save_atomic(winner, target, "ticket")
    _print_selection(payload, selection, chosen_eps1, settings.nu)
    data = payload["data"]
    spend = ("no privacy: the best score, for tickets from public data (if the ticket data is your private "
             "data, this selection is non-private)" if best else
             f"spends ε1 = {settings.eps1:g} on {data['dataset']} ({data['split']}), the data that made the tickets")
    err_console.print(f"winner: round {winner['round']} (C = {winner['density']:.4f}, A = {winner['val_accuracy']:.4f}); "
                      f"selection {spend}")
    err_console.print(f"ticket file: {target}")
    return winner, target


@app.command()
@user_errors
def train(
    ticket: Annotated[Path | None, typer.Option(help="Winning ticket from `dpltm select`.")] = None,
    dataset: Annotated[str | None, typer.Option(help="Private dataset to train on (default mnist).")] = None,
    split: Annotated[str | None, typer.Option(help="Official split to draw from: train, test or all.")] = None,
    eps2: Annotated[float | None, typer.Option(help="Training budget ε2; σ is calibrated to it (paper: 0.9).")] = None,
    delta: Annotated[float | None, typer.Option(help="δ (paper: 1e-5).")] = None,
    sigma: Annotated[float | None, typer.Option(help="Noise multiplier σ (skips calibration; ε is reported).")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs (paper: 50).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Expected batch size L (Poisson sampling, q = L/N).")] = None,
    clip: Annotated[float | None, typer.Option(help="Per-sample clipping norm C (paper: 1).")] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate (paper: 0.1).")] = None,
    optimizer: Annotated[str | None, typer.Option(help="sgd or adam (NoisyAdam).")] = None,
    noise: Annotated[str | None, typer.Option(help="Noise plug-in: gaussian, dpd (differentially private dropout; --sigma is its σ, accounted as 2σ) or shaped (needs --public-data).")] = None,
    accountant: Annotated[str | None, typer.Option(help="pld (default) or rdp.")] = None,
    target_eps: Annotated[float | None, typer.Option("--target-eps", help="Stop before spending more than this.")] = None,
    patience: Annotated[int | None, typer.Option(help="Early-stop after this many epochs without validation gain.")] = None,
    dense: Annotated[bool, typer.Option("--dense", help="DP-SGD baseline on the full network (no ticket).")] = False,
    non_private: Annotated[bool, typer.Option("--non-private", help="Train without privacy (baseline).")] = False,
    public_tickets: Annotated[bool, typer.Option("--public-tickets", help="Assert the ticket's generation data is public even though it has the private dataset's name.")] = False,
    val_fraction: Annotated[float | None, typer.Option(help="Fraction held out for validation.")] = None,
    public_data: Annotated[str | None, typer.Option("--public-data", help="Public DATASET[:SPLIT] for noise plug-ins that need it (shaped); never the private dataset.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for the data split and any fresh layer.")] = None,
    noise_seed: Annotated[int | None, typer.Option("--noise-seed", help="Seed the noise and Poisson sampling (reproducible; DP only while the seed stays secret). Default: a fresh OS-CSPRNG seed, never stored.")] = None,
    device: Device = "auto",
    config: ConfigFile = None,
    data_dir: DataDir = None,
    out: Annotated[Path | None, typer.Option(help="Model checkpoint (default checkpoints/<dataset>-<mode>.pt).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    json_out: Json = False,
) -> None:
    """Phase 3: DP-SGD on the masked winner (or --dense / --non-private baselines)."""
    if dense and ticket is not None:
        raise DpltmUserError("--dense trains the full network: drop --ticket")
    if sigma is not None and eps2 is not None:
        raise DpltmUserError("give --eps2 (σ is calibrated to it) or --sigma (ε is reported), not both")
    if not dense and ticket is None:
        raise DpltmUserError("give --ticket PATH (from `dpltm select`), or --dense for the DP-SGD baseline")
    cli = {
        "data": {"dataset": dataset, "split": split, "val_fraction": val_fraction},
        "train": {"eps2": eps2, "delta": delta, "sigma": sigma, "epochs": epochs, "batch_size": batch_size,
                  "clip": clip, "lr": lr, "optimizer": optimizer, "noise": noise, "accountant": accountant,
                  "target_eps": target_eps, "patience": patience},
        "seed": seed,
    }
    report = stage_train(cli, config, ticket, non_private, public_tickets, data_dir, device, out, progress,
                         public_data=public_data, noise_seed=noise_seed)
    _finish_training_report(report, json_out)


def stage_train(cli: dict[str, Any], config: Path | None, ticket: Path | None, non_private: bool,
                public_tickets: bool, data_dir: Path | None, device: str, out: Path | None,
                progress: bool, public_data: str | None = None, noise_seed: int | None = None) -> dict[str, Any]:
    from dpltm import pipeline
    from dpltm.checkpoint import check_writable
    from dpltm.config import resolve_train_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.paths import default_checkpoint_dir

    cfg = resolve_train_config(cli, config)
    ticket_body = pipeline.load_ticket(ticket) if ticket is not None else None
    mode = ("dpltm" if ticket is not None else "dense") + ("-nonprivate" if non_private else "")
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-{mode}.pt"
    check_writable(target)
    torch_device = resolve_device(device)
    public_name, public_split = (public_data.split(":", 1) + ["train"])[:2] if public_data else (None, None)
    if public_name is not None and cfg.train.noise != "shaped":
        raise DpltmUserError(f"--public-data is only used by --noise shaped (this run uses {cfg.train.noise})")
    if public_name is not None and public_name == cfg.data.dataset:
        raise DpltmUserError(f"--public-data must be public: it names the private dataset {cfg.data.dataset}")
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    public = None if public_name is None else load_dataset(
        public_name, split=public_split, data_dir=data_dir, device=torch_device).train
    err_console.print(f"training on {data.name} ({len(data.train)} records) on {torch_device}: "
                      f"{'NON-PRIVATE baseline' if non_private else 'DP-SGD'}"
                      f"{' on the dense network' if ticket is None else f' on ticket {ticket}'}")
    return pipeline.train(cfg, data, target, ticket=ticket_body, ticket_path=ticket, private=not non_private,
                          assert_public=public_tickets, progress=progress, public_data=public,
                          public_dataset=public_name, noise_seed=noise_seed)


def _finish_training_report(report: dict[str, Any], json_out: bool) -> None:
    err_console.print(f"test accuracy {report['test_accuracy']:.4f} (validation {report['val_accuracy']:.4f}) "
                      f"after {report['epochs_run']} epochs, {report['steps']} steps: {report['stop_reason']}")
    if report["noise_multiplier"] is not None:
        how = "calibrated" if report["sigma_calibrated"] else "given"
        if report["noise_parameter"] != report["noise_multiplier"]:
            how = f"effective; plug-in parameter {report['noise_parameter']:.4f}, {how}"
        err_console.print(f"noise multiplier σ = {report['noise_multiplier']:.4f} ({how}), q = {report['sample_rate']:.5f}")
    err_console.print(report["statement"], markup=False, highlight=False)
    err_console.print(f"model: {report['output']}")
    if json_out:
        emit_json({k: v for k, v in report.items() if k != "statement"})


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
    eps: Annotated[float | None, typer.Option("--eps", help="Solve for σ reaching this ε instead.")] = None,
    eps1: Annotated[float | None, typer.Option(help="Also compose with an ε1 exponential-mechanism selection.")] = None,
    noise: Annotated[str, typer.Option(help="Noise plug-in --sigma belongs to: gaussian, dpd (accounted as 2σ; adds the DPD paper's own zCDP figure as a labelled comparison) or shaped.")] = "gaussian",
    json_out: Json = False,
) -> None:
    """ε of Poisson-subsampled Gaussian DP-SGD by each accountant, side by side (or σ for a target ε)."""
    from dpltm.accounting_report import account_report, print_account_report

    report = account_report(q=q, sigma=sigma, steps=steps, delta=delta, dataset_size=dataset_size,
                            batch_size=batch_size, epochs=epochs, eps=eps, eps1=eps1, noise=noise)
    if json_out:
        emit_json(report)
    else:
        print_account_report(report, out_console)


@app.command()
@user_errors
def run(
    dataset: Annotated[str, typer.Option(help="Private dataset to train on.")] = "mnist",
    public_dataset: Annotated[str, typer.Option(help="Public dataset the tickets come from.")] = "kmnist",
    public_split: Annotated[str, typer.Option(help="Split of the public dataset (KMNIST here: test).")] = "test",
    eps: Annotated[float, typer.Option(help="Privacy budget ε for the private data (all of it goes to training: public tickets cost nothing).")] = 1.0,
    delta: Annotated[float, typer.Option(help="δ.")] = 1e-5,
    epochs: Annotated[int | None, typer.Option(help="DP training epochs (paper: 50).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Expected DP batch size L (paper: 400).")] = None,
    rounds: Annotated[int | None, typer.Option(help="Pruning rounds (paper-style default: 10).")] = None,
    iterations: Annotated[int | None, typer.Option(help="SGD iterations per ticket (paper: 5000).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
    device: Device = "auto",
    config: ConfigFile = None,
    data_dir: DataDir = None,
    out: Annotated[Path | None, typer.Option(help="Model checkpoint (default checkpoints/<dataset>-dpltm.pt).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
    json_out: Json = False,
) -> None:
    """All three stages with the paper's defaults, in the sound mode: public tickets → DP training."""
    from dpltm.paths import default_checkpoint_dir

    if public_dataset == dataset:
        raise DpltmUserError("`dpltm run` uses public tickets: --public-dataset must differ from --dataset "
                             "(for the paper's same-data mode run generate, select and train yourself)")
    from dpltm.config import resolve_train_config

    folder = default_checkpoint_dir()
    train_cli = {"data": {"dataset": dataset}, "train": {"eps2": eps, "delta": delta, "epochs": epochs,
                                                         "batch_size": batch_size}, "seed": seed}
    resolve_train_config(train_cli, config)  # validate before the (long) ticket generation
    err_console.print(f"[bold]1/3[/bold] tickets from public data: {public_dataset} ({public_split} split)")
    gen_cli = {"data": {"dataset": public_dataset, "split": public_split},
               "generate": {"rounds": rounds, "iterations": iterations}, "seed": seed}
    tickets_path = folder / f"{public_dataset}-{public_split}-tickets.pt"
    stage_generate(gen_cli, config, data_dir, device, tickets_path, False, progress)
    err_console.print("[bold]2/3[/bold] selection on public tickets (best score; spends nothing on private data)")
    winner_path = folder / f"{public_dataset}-{public_split}-winner.pt"
    stage_select({"select": {}}, config, tickets_path, True, seed, winner_path)
    err_console.print(f"[bold]3/3[/bold] DP training on {dataset} at ε = {eps:g}, δ = {delta:g}")
    report = stage_train(train_cli, config, winner_path, False, False, data_dir, device,
                         out or folder / f"{dataset}-dpltm.pt", progress)
    _finish_training_report(report, json_out)


def main() -> None:
    """Entry point: the parser's own usage errors become one line too."""
    from typer.exceptions import Abort, TyperException

    try:
        code = app(standalone_mode=False)  # returns typer.Exit's code instead of exiting
    except Abort:
        typer.echo("dpltm: interrupted", err=True)
        raise SystemExit(130) from None
    except TyperException as exc:  # usage errors: bad option, bad value, missing argument
        message = " ".join(exc.format_message().split())
        typer.echo(f"dpltm: error: {message}", err=True)
        raise SystemExit(max(int(getattr(exc, "exit_code", 2)), 2)) from None
    if isinstance(code, int) and code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
