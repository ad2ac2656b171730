"""The `dpltm` command line: generate → select → train, plus inspect and account.

Every user mistake surfaces as one line on stderr and exit code 2 (no traceback). Progress
and logs go to stderr; `--json` reports go to stdout, so the output can be piped.
"""

from __future__ import annotations

import functools
import json
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


def emit_json(report: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")


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
    from dpltm.checkpoint import check_writable
    from dpltm.config import resolve_generate_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.lottery import generate_tickets
    from dpltm.paths import default_checkpoint_dir
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

    payload = generate_tickets(cfg, data, target, overwrite=overwrite, progress=progress,
                               on_round=on_round)
    if json_out:
        emit_json({**tickets_json(payload), "output": str(target)})
    else:
        print_tickets(payload, err_console)
        err_console.print(f"ticket file: {target}")


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
