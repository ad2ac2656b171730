"""Phase 1 as a command: resolve the settings, load the data, run IMP into a locked ticket file."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.console import err_console, on_interrupt_kept
from dpltm.errors import DpltmUserError
from dpltm.paths import check_not_input
from dpltm.privacy.display import format_delta, format_epsilon, format_rate, format_sigma

if TYPE_CHECKING:
    from dpltm.artefacts import TicketRecord, TicketSet, Winner
    from dpltm.options import Overrides
    from dpltm.run_log import RunLog
    from dpltm.settings import GenerateConfig, GenerateSettings


def stage_generate(cli: Overrides, config: Path | None, data_dir: Path | None, device: str,
                   out: Path | None, overwrite: bool, progress: bool,
                   cuda_graphs: bool = False, logger: str | None = None,
                   log_dir: Path | None = None, download: bool = False) -> tuple[TicketSet, Path]:
    """IMP into a locked ticket file; with `logger` (csv, tensorboard, mlflow or none) the run also
    gets a versioned log folder (dpltm.run_log): each round's density, validation accuracy and
    training-loss curve at its global SGD step."""
    from dpltm.config import resolve_generate_config
    from dpltm.data import load_dataset
    from dpltm.devices import require_cuda_for_graphs, resolve_device
    from dpltm.outputs import output_lock
    from dpltm.tickets.imp import generate_tickets

    cfg = resolve_generate_config(cli, config)
    target = tickets_target(cfg, out, config)
    torch_device = resolve_device(device)
    if cuda_graphs:
        require_cuda_for_graphs(torch_device)
    if download:
        from dpltm.data.download import fetch_for_run

        fetch_for_run([cfg.data.dataset], data_dir)
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    check_not_input(target)  # a data file just read
    if len(data.val) == 0:  # per-record hold-outs are binomial: a tiny fraction of a small set can draw none
        raise DpltmUserError(f"--val-fraction {cfg.data.val_fraction:g} drew no validation records from "
                             f"{data.name}'s {len(data.train)}, and each ticket is scored by its validation accuracy: "
                             "give a larger fraction")
    if logger is not None:
        from dpltm.run_log import check_log_root

        check_log_root(log_dir, "generate", cfg.data.dataset)
    resuming = target.exists() and not overwrite  # generate_tickets resumes it
    if resuming:
        from dpltm.tickets.imp import resumable_set

        resumable_set(cfg, data, target)  # another kind, damaged, or other settings: refused before the banner
    err_console.print(
        (f"continuing the tickets in {target} (its finished rounds are kept)" if resuming else "generating tickets")
        + f" on {data.name} ({data.source_split} split: {len(data.train)} train, "
        f"{len(data.val)} val, {len(data.test)} test) on {torch_device}; "
        f"phase 1 is NOT private: it sees this data directly"
    )
    if cfg.generate.batch_size > len(data.train):  # dpltm.data.batches.ShuffledBatches takes the whole set a step
        err_console.print(f"note: --batch-size {cfg.generate.batch_size} is above the {len(data.train)} training "
                          f"records: every step takes all {len(data.train)} (full-batch IMP)", markup=False,
                          highlight=False)

    from dpltm.config import to_dict
    from dpltm.run_log import RunLog

    run_log: RunLog | None = None  # claimed once the output is locked: a refused run leaves no folder

    def on_round(record: TicketRecord) -> None:
        on_interrupt_kept(f"finished rounds are kept in {target}; rerun the same command to resume")
        err_console.print(f"round {record.round}: C={record.density:.4f} val acc={record.val_accuracy:.4f}")
        if run_log is not None:
            log_round(run_log, record, cfg.generate)

    with output_lock(target):
        if logger is not None:
            run_log = RunLog("generate", cfg.data.dataset, logger, log_dir, to_dict(cfg), mode="imp")
        with run_log.closed_on_error() if run_log else contextlib.nullcontext():
            on_interrupt_kept(f"no round finished in this run; {target} is as it was" if target.exists() else
                               f"no round had finished: nothing was written to {target}")
            tickets = generate_tickets(cfg, data, target, overwrite=overwrite, progress=progress,
                                       on_round=on_round, cuda_graphs=cuda_graphs)
    if run_log is not None:
        run_log.finish(output=str(target), tickets=run_tickets(tickets), stop_reason=tickets.stop_reason)
        err_console.print(f"log: {run_log.folder}")
    return tickets, target


def tickets_target(cfg: GenerateConfig, out: Path | None, config: Path | None) -> Path:
    """The ticket file, checked before any data is read (and --prune-rates against the network with it)."""
    from dpltm.outputs import check_checkpoint_name, check_writable, same_file
    from dpltm.paths import default_checkpoint_dir

    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-tickets.pt"
    if config is not None and same_file(target, config):
        raise DpltmUserError(f"--out {target} is this command's --config file: write the tickets elsewhere")
    check_checkpoint_name(target)
    check_writable(target)
    check_prune_rates(cfg)
    return target


def log_round(run_log: RunLog, record: TicketRecord, imp: GenerateSettings) -> None:
    """A round's loss curve and result at their global SGD steps: rounds after the first train iterations − K
    steps with late rewinding."""
    k, iterations, later = record.round, imp.iterations, imp.iterations - imp.rewind_step
    first, steps = (0, iterations) if k == 0 else (iterations + (k - 1) * later, later)
    for i, loss in enumerate(record.loss_curve):
        run_log.log_metrics({"train_loss": loss}, step=first + i * (record.loss_every or 0))
    run_log.log_metrics({"round": k, "density": record.density, "val_accuracy": record.val_accuracy},
                        step=first + steps)


def check_prune_rates(cfg: GenerateConfig) -> None:
    """--prune-rates against the network's layers, before any data is read (a known dataset's shape is
    fixed: dpltm.data.loaders.SPECS)."""
    from dpltm.data.loaders import SPECS
    from dpltm.networks.lenet import build_architecture
    from dpltm.tickets.imp import resolve_prune_rates

    spec = SPECS.get(cfg.data.dataset)
    if spec is not None and cfg.generate.prune_rates is not None:
        resolve_prune_rates(build_architecture(spec.num_features, spec.num_classes, cfg.model.hidden,
                                               cfg.model.project_to, cfg.model.activation, cfg.model.arch),
                            cfg.generate.prune_rates)


def run_tickets(tickets: TicketSet) -> list[dict[str, Any]]:
    """The tickets as run.json records (`dpltm plot`): IMP tickets and, when trained, the controls."""
    rows = []
    for t in tickets.tickets:
        rows.append({"round": t.round, "density": t.density, "val_accuracy": t.val_accuracy,
                     "test_accuracy": None, "kind": "imp"})
        for key, kind in (("reinit", "random-reinit"), ("random_mask", "random-mask")):
            if key in (t.controls or {}):
                rows.append({"round": t.round, "density": t.density, "kind": kind, "test_accuracy": None,
                             "val_accuracy": t.controls[key]["val_accuracy"]})  # type: ignore[index]
    return rows


def stage_generate_private(cli: Overrides, config: Path | None, data_dir: Path | None, device: str,
                           out: Path | None, overwrite: bool, progress: bool,
                           noise_seed: int | None = None, logger: str | None = None,
                           log_dir: Path | None = None, download: bool = False) -> tuple[Winner, Path]:
    """`generate --private`: a ticket made on the private data by DP warm-up (dpltm.tickets.private).
    `cli` is a training config tree: the warm-up uses the `train:` recipe, `private_ticket:` the rest."""
    from dpltm.config import resolve_train_config
    from dpltm.console import warn_large_delta
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.outputs import output_lock, prepare_output
    from dpltm.paths import default_checkpoint_dir
    from dpltm.tickets.private import (
        check_private_prune,
        make_private_ticket,
        plan_private_ticket,
        ticket_architecture,
    )

    cfg = resolve_train_config(cli, config)
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-private-ticket.pt"
    prepare_output(target, overwrite=overwrite, inputs=[config], checkpoint=True)
    torch_device = resolve_device(device)
    if download:
        from dpltm.data.download import fetch_for_run

        fetch_for_run([cfg.data.dataset], data_dir)
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    check_not_input(target)  # a data file just read
    plan = plan_private_ticket(cfg, len(data.train))
    check_private_prune(ticket_architecture(cfg, data), cfg.private_ticket)
    p = cfg.private_ticket
    err_console.print(
        f"private ticket on {data.name} ({len(data.train)} training records) on {torch_device}: "
        f"{p.rounds} DP warm-up round(s) of {p.warmup_epochs} epochs, then {cfg.train.epochs} epochs of training "
        f"planned; σ = {format_sigma(plan.noise_multiplier)} for the warm-up, q = "
        f"{format_rate(plan.sample_rate)}, planned so that "
        f"the whole run is (ε = {format_epsilon(plan.epsilon)}, δ = {format_delta(plan.delta)})-DP (training "
        f"calibrates its own σ after "
        "the warm-up that ran: never less noise than planned)"
    )
    warn_large_delta(plan.delta, len(data.train))  # as train and make_private warn

    from dpltm.config import to_dict
    from dpltm.run_log import RunLog

    run_log: RunLog | None = None  # claimed once the output is locked
    rounds: list[dict[str, Any]] = []

    def on_round(record: dict[str, Any]) -> None:
        on_interrupt_kept(f"finished rounds are kept in {target}; rerun the same command to resume")
        val = record["val_accuracy"]
        err_console.print(f"warm-up round {record['round']}: C={record['density']:.4f} "
                          + (f"val acc={val:.4f}, " if val == val else "(no validation set), ")
                          + f"ε so far ≤ {format_epsilon(record['epsilon_so_far'])}")
        rounds.append({"round": record["round"], "density": record["density"], "kind": "dp-warm-up",
                       "val_accuracy": record["val_accuracy"], "test_accuracy": None,
                       "epsilon": record["epsilon_so_far"]})
        if run_log is not None:
            run_log.log_metrics({"density": record["density"], "val_accuracy": record["val_accuracy"],
                                 "epsilon": record["epsilon_so_far"]}, step=record["round"])

    with output_lock(target):
        if logger is not None:
            run_log = RunLog("generate", cfg.data.dataset, logger, log_dir, to_dict(cfg), mode="private-ticket")
        with run_log.closed_on_error() if run_log else contextlib.nullcontext():
            on_interrupt_kept("no ticket was written" + (f" (the file at {target} is unchanged)"
                                                         if target.exists() else ""))
            ticket = make_private_ticket(cfg, data, target, progress=progress, noise_seed=noise_seed,
                                         on_round=on_round)
    if run_log is not None:
        run_log.finish(output=str(target), tickets=rounds)
        err_console.print(f"log: {run_log.folder}")
    return ticket, target
