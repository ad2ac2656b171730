"""Phase 2 as a command: the exponential mechanism, the paper's best score, or the noise-aware
choice; every exponential draw is recorded in the ticket file before its winner is written."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from dpltm.console import err_console
from dpltm.dp.plugins import noise_plugin
from dpltm.errors import DpltmUserError


def _print_selection(payload: dict[str, Any], selection: Any, eps1: float | None, nu: float,
                     noise_aware: bool = False) -> None:
    from rich.table import Table

    title = (f"noise-aware choice over {len(payload['tickets'])} tickets: public validation accuracy after the "
             "planned DP training" if noise_aware else
             f"selection over {len(payload['tickets'])} tickets, S = A·(1 − {nu:g}·C)")
    table = Table(title=title)
    score_name = "acc. under planned noise" if noise_aware else "score S"
    for column in ("round", "C", "A (val)", score_name, "P(select)"):
        table.add_column(column, justify="right")
    for i, t in enumerate(payload["tickets"]):
        mark = " ←" if i == selection.index else ""
        table.add_row(str(t["round"]), f"{t['density']:.4f}", f"{t['val_accuracy']:.4f}",
                      f"{selection.scores[i]:.4f}", f"{selection.probabilities[i]:.4f}{mark}")
    err_console.print(table)
    if noise_aware:
        return
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


def same_data_note(data: dict[str, Any]) -> str:
    return (f"these tickets were generated WITHOUT privacy on {data['dataset']} ({data['split']} split): a model "
            f"trained on that data from them is NOT end-to-end differentially private; on other data they are public")


class TicketSource(str, Enum):
    """Where `dpltm run` takes its ticket from."""

    public = "public"
    private = "private"


class TicketChoice(str, Enum):
    noise_aware = "noise-aware"
    best = "best"


@dataclass(frozen=True)
class NoiseAwareRequest:
    """What the noise-aware choice needs besides the tickets: the planned private run."""

    private_size: int
    train_cli: dict[str, Any]
    data_dir: Path | None
    device: str
    progress: bool = True
    """A bar with an ETA on stderr while the candidates train (the longest phase of `dpltm run`)."""


def _noise_aware_choice(payload: dict[str, Any], request: NoiseAwareRequest, config: Path | None,
                        seed: int | None) -> Any:
    from dpltm.config import resolve_train_config
    from dpltm.devices import resolve_device
    from dpltm.selection.noise_aware import PlannedRun, noise_aware_choice
    from dpltm.training.pipeline import reload_ticket_data
    from dpltm.training.plain import step_bar
    from dpltm.training.private import plan_training

    cfg = resolve_train_config(request.train_cli, config)
    s = cfg.train
    if not noise_plugin(s.noise).plain_norm:
        raise DpltmUserError(f"--noise-aware simulates Gaussian-type noise; with --noise {s.noise} use --best")
    plan = plan_training(s, request.private_size)
    planned = PlannedRun(plan.noise_multiplier, plan.expected_batch_size, plan.steps, s.clip, plan.lr, s.optimizer,
                         s.momentum, cfg.model.activation, s.ema)
    public = reload_ticket_data(payload, request.data_dir).to(resolve_device(request.device))
    err_console.print(f"noise-aware choice: {len(payload['tickets'])} candidates (dense included), each trained "
                      f"{plan.steps} steps under σ = {plan.noise_multiplier:.4f}, L = {plan.expected_batch_size}, "
                      f"on {public.name} ({public.source_split} split, the tickets' public data); spends no ε")
    with step_bar("noise-aware choice", plan.steps, enabled=request.progress) as bar:
        choice = noise_aware_choice(payload, public, planned, seed=seed,
                                    on_progress=lambda done, _: bar.update(done - bar.n))
    return choice


def stage_select(cli: dict[str, Any], config: Path | None, tickets: Path | None, best: bool,
                 seed: int | None, out: Path | None, *, overwrite: bool = False,
                 reselect: bool = False, noise_aware: NoiseAwareRequest | None = None) -> tuple[dict[str, Any], Path]:
    from dpltm.checkpoint import load_checkpoint, output_lock, prepare_output, save_atomic
    from dpltm.config import resolve_select_config
    from dpltm.paths import default_checkpoint_dir
    from dpltm.selection.winner import choose, newest_ticket_set, noise_aware_selection, previous_draws, winner_payload

    settings = resolve_select_config(cli, config)
    source = tickets
    if source is None:
        source = newest_ticket_set(default_checkpoint_dir())
        err_console.print(f"using the newest ticket set in {default_checkpoint_dir()}/: {source} (--tickets to choose)")
    payload = load_checkpoint(source, ("tickets", "ticket"))
    if payload["kind"] == "ticket":
        what = "a private ticket (generate --private)" if payload["selection"]["method"] == "private" else "a winner"
        raise DpltmUserError(f"{source} is {what}, not a ticket set: it needs no selection; train it with "
                             f"`dpltm train --ticket {source}`")
    target = out or default_checkpoint_dir() / f"{payload['data']['dataset']}-winner.pt"
    prepare_output(target, overwrite=overwrite, inputs=[source, config])
    chosen_eps1 = None if best or noise_aware is not None else settings.eps1
    choice = None if noise_aware is None else _noise_aware_choice(payload, noise_aware, config, seed)
    with contextlib.ExitStack() as stack:
        if chosen_eps1 is not None:  # the draw is recorded in the ticket file: lock it, re-read it
            stack.enter_context(output_lock(source))
            payload = load_checkpoint(source, "tickets")
            draws = previous_draws(payload)
            if draws and not reselect:
                raise DpltmUserError(
                    f"{source} was already drawn from {len(draws)} time(s) (ε1 = {sum(draws):g} in all): another "
                    f"draw spends ε1 again on {payload['data']['dataset']}; pass --reselect to draw again "
                    f"(the winner's ledger then composes every draw)")
        stack.enter_context(output_lock(target))
        selection = (noise_aware_selection(choice) if choice is not None
                     else choose(payload, eps1=chosen_eps1, nu=settings.nu, seed=seed))
        winner = winner_payload(payload, source, selection, eps1=chosen_eps1, nu=settings.nu, seeded=seed is not None,
                                noise_aware=choice)
        if chosen_eps1 is not None:  # recorded before the winner is released, so no draw goes uncounted
            payload["selection_draws"] = [*previous_draws(payload), chosen_eps1]
            save_atomic(payload, source, "tickets")
        save_atomic(winner, target, "ticket")
    _print_selection(payload, selection, chosen_eps1, settings.nu, noise_aware=choice is not None)
    data = payload["data"]
    spend = ("no privacy: the best public accuracy under the planned noise (if the ticket data is your private "
             "data, this selection is non-private)" if choice is not None else
             "no privacy: the best score, for tickets from public data (if the ticket data is your private "
             "data, this selection is non-private)" if best else
             f"spends ε1 = {settings.eps1:g} on {data['dataset']} ({data['split']}), the data that made the tickets"
             + (f"; {winner['selection']['draws']} draws from this ticket set, ε1 = "
                f"{winner['selection']['eps1_total']:g} in all" if winner["selection"]["draws"] > 1 else ""))
    err_console.print(f"winner: round {winner['round']} (C = {winner['density']:.4f}, "
                      f"A = {winner['val_accuracy']:.4f}); selection {spend}")
    err_console.print(same_data_note(data), markup=False)
    err_console.print(f"ticket file: {target}")
    return winner, target
