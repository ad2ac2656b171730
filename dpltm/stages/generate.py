"""Phase 1 as a command: resolve the settings, load the data, run IMP into a locked ticket file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpltm.console import err_console, on_interrupt_kept
from dpltm.errors import DpltmUserError


def stage_generate(cli: dict[str, Any], config: Path | None, data_dir: Path | None, device: str,
                   out: Path | None, overwrite: bool, progress: bool,
                   cuda_graphs: bool = False) -> tuple[dict[str, Any], Path]:
    from dpltm.checkpoint import check_writable, output_lock, same_file
    from dpltm.config import resolve_generate_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.lottery import generate_tickets
    from dpltm.paths import default_checkpoint_dir

    cfg = resolve_generate_config(cli, config)
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-tickets.pt"
    if config is not None and same_file(target, config):
        raise DpltmUserError(f"--out {target} is this command's --config file: write the tickets elsewhere")
    check_writable(target)
    torch_device = resolve_device(device)
    if cuda_graphs and torch_device.type != "cuda":
        raise DpltmUserError("--cuda-graphs needs a CUDA device (--device cuda)")
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
            f"val acc={record['val_accuracy']:.4f}"
        )

    with output_lock(target):
        on_interrupt_kept(f"finished rounds are kept in {target}; rerun the same command to resume")
        payload = generate_tickets(cfg, data, target, overwrite=overwrite, progress=progress, on_round=on_round,
                                   cuda_graphs=cuda_graphs)
    return payload, target


def stage_generate_private(cli: dict[str, Any], config: Path | None, data_dir: Path | None, device: str,
                           out: Path | None, overwrite: bool, progress: bool,
                           noise_seed: int | None = None) -> tuple[dict[str, Any], Path]:
    """`generate --private`: a ticket made on the private data by DP warm-up (dpltm.private_tickets).
    `cli` is a training config tree: the warm-up uses the `train:` recipe, `private_ticket:` the rest."""
    from dpltm.checkpoint import output_lock, prepare_output
    from dpltm.config import resolve_train_config
    from dpltm.data import load_dataset
    from dpltm.devices import resolve_device
    from dpltm.paths import default_checkpoint_dir
    from dpltm.private_tickets import make_private_ticket, plan_private_ticket

    cfg = resolve_train_config(cli, config)
    target = out or default_checkpoint_dir() / f"{cfg.data.dataset}-private-ticket.pt"
    prepare_output(target, overwrite=overwrite, inputs=[config])
    torch_device = resolve_device(device)
    data = load_dataset(cfg.data.dataset, split=cfg.data.split, data_dir=data_dir,
                        val_fraction=cfg.data.val_fraction, seed=cfg.seed, device=torch_device)
    plan = plan_private_ticket(cfg, len(data.train))
    p = cfg.private_ticket
    err_console.print(
        f"private ticket on {data.name} ({len(data.train)} training records) on {torch_device}: "
        f"{p.rounds} DP warm-up round(s) of {p.warmup_epochs} epochs, then {cfg.train.epochs} epochs of training "
        f"planned; one σ = {plan.noise_multiplier:.4f} for every phase, q = {plan.sample_rate:.5f}, so the whole "
        f"run is (ε = {plan.epsilon:g}, δ = {plan.delta:g})-DP"
    )

    def on_round(record: dict[str, Any]) -> None:
        err_console.print(f"warm-up round {record['round']}: C={record['density']:.4f} "
                          f"val acc={record['val_accuracy']:.4f}, ε so far ≤ {record['epsilon_so_far']:.4g}")

    with output_lock(target):
        on_interrupt_kept("no ticket was written" + (f" (the file at {target} is unchanged)"
                                                     if target.exists() else ""))
        payload = make_private_ticket(cfg, data, target, progress=progress, noise_seed=noise_seed,
                                      on_round=on_round)
    return payload, target
