"""Phase 2 as a command: a selection rule of dpltm.selection.rules, picked by name (the exponential
mechanism, the paper's best score, the noise-aware choice, …); every draw that spends ε1 is recorded in
the ticket file before its winner is written."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpltm.console import err_console
from dpltm.errors import DpltmUserError
from dpltm.privacy.display import format_epsilon
from dpltm.selection.rules import RuleSettings, SelectionRule, selection_rule

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, Winner
    from dpltm.options import Overrides


def _print_selection(ticket_set: TicketSet, selection: Any, rule: SelectionRule, eps1: float | None,
                     nu: float) -> None:
    from rich.table import Table

    choice = (selection.record or {}).get("noise_aware") or {}
    if choice.get("searched"):
        _print_variants(choice, ticket_set, rule)
        return
    table = Table(title=rule.title.format(k=len(ticket_set.tickets), nu=nu))
    paired = choice.get("candidates")  # gains over dense, ± SE
    columns = ("round", "C", "A (val)", rule.score_name, *(("vs dense ± 2 SE",) if paired else ()), "P(select)")
    for column in columns:
        table.add_column(column, justify="right")
    for i, t in enumerate(ticket_set.tickets):
        mark = " ←" if i == selection.index else ""
        stopped = (f" (step {paired[i]['steps']})" if paired and paired[i].get("steps", 0)
                   < max(c.get("steps", 0) for c in paired) else "")  # dropped by successive halving
        gain = ((f"{paired[i]['gain_over_dense']:+.4f} ± {2 * paired[i]['gain_standard_error']:.4f}" if i else "–",)
                if paired else ())
        table.add_row(str(t.round), f"{t.density:.4f}", f"{t.val_accuracy:.4f}",
                      f"{selection.scores[i]:.4f}{stopped}", *gain, f"{selection.probabilities[i]:.4f}{mark}")
    err_console.print(table)
    if rule.note is not None:
        err_console.print(rule.note)
    if not rule.spends_eps1:
        return
    err_console.print(f"exponential mechanism: ε1 = {format_epsilon(eps1)}, sensitivity Δ = "
                      f"{selection.sensitivity:.4g}")
    if selection.near_uniform:
        err_console.print(
            f"[bold]the choice is close to uniform at ε1 = {format_epsilon(eps1)}[/bold] (every probability "
            f"within 10 % of "
            f"1/{len(ticket_set.tickets)}); ε1 ≈ {selection.decisive_eps1:.3g} would pick the best ticket "
            f"with probability 0.9"
        )


def _print_variants(choice: dict[str, Any], ticket_set: TicketSet, rule: SelectionRule) -> None:
    """The noise-aware choice's candidates when it searched more than the ticket: one row per ticket and
    variant (start, frozen layers, released weights), the winner marked."""
    from rich.table import Table

    from dpltm.selection.winner import describe_variant

    candidates = choice["candidates"]
    searched = ", ".join(choice["searched"])
    table = Table(title=f"noise-aware choice: {len(ticket_set.tickets)} tickets × variants ({searched}), "
                  f"{len(candidates)} candidates")
    for column in ("round", "C", "start", "frozen", "released", "public val acc", "vs dense as planned ± 2 SE"):
        table.add_column(column, justify="right")
    chosen = choice.get("chosen") or {}
    winner_round = ticket_set.tickets[choice["index"]].round
    for i, c in enumerate(candidates):
        released = ("final iterate" if c["ema"] is None
                    else f"EMA {c['ema']:g}" + (" (warm-up)" if c["ema_warmup"] else ""))
        mark = " ←" if (c["round"] == winner_round and c["start"] == chosen.get("start")
                        and list(c["freeze"]) == list(chosen.get("freeze", [])) and c["ema"] == chosen.get("ema")
                        and c["ema_warmup"] == chosen.get("ema_warmup")) else ""
        steps = max(x.get("steps", 0) for x in candidates)
        stopped = f" (step {c['steps']})" if c.get("steps", 0) < steps else ""
        table.add_row(str(c["round"]), f"{c['density']:.4f}", start_label(c["start"]),
                      ",".join(c["freeze"]) or "–", released, f"{c['public_val_accuracy']:.4f}{stopped}",
                      ("–" if i == 0 else f"{c['gain_over_dense']:+.4f} ± {2 * c['gain_standard_error']:.4f}") + mark)
    err_console.print(table)
    if rule.note is not None:
        err_console.print(rule.note)
    if chosen:
        err_console.print(f"chosen variant: {describe_variant({'rewind': chosen['start'], **chosen})}; `train` runs "
                          "the winner so unless the --config file or flags say otherwise", markup=False,
                          highlight=False)


def start_label(start: str) -> str:
    """A candidate's start in the variants table: public, θ0, or θ_K (late rewinding)."""
    return {"public": "public", "init": "θ0"}.get(start, f"θ_{start}")


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
    train_cli: Overrides
    data_dir: Path | None
    device: str
    progress: bool = True
    """A bar with an ETA on stderr while the candidates train (the longest phase of `dpltm run`)."""


def check_halving(halving: int, *, noise_aware: bool, name: str) -> None:
    """Successive halving (`select.halving`, --halving) is a setting of the noise-aware choice only."""
    if halving and not noise_aware:
        raise DpltmUserError(f"--halving (select.halving) drops candidates of the noise-aware choice while they "
                             f"train: the {name} selection trains none (drop --halving, or set select.halving: 0)")


def check_search(search: tuple[str, ...], *, noise_aware: bool, name: str) -> None:
    """`select.search` (--search) is a setting of the noise-aware choice only: no other rule trains anything."""
    if search and not noise_aware:
        raise DpltmUserError(f"--search ({', '.join(search)}; select.search) widens the noise-aware choice: the {name} "
                             "selection trains no candidate (drop --search, or set select.search: [])")


def rule_for_flags(best: bool, noise_aware: bool) -> str:
    """The selection rule the CLI's flags name: --noise-aware, --best, else the exponential mechanism."""
    return "noise-aware" if noise_aware else "best" if best else "exponential"


def stage_select(cli: Overrides, config: Path | None, tickets: Path | None, best: bool,
                 seed: int | None, out: Path | None, *, overwrite: bool = False,
                 reselect: bool = False, noise_aware: NoiseAwareRequest | None = None,
                 rule: str | None = None) -> tuple[Winner, Path]:
    """Choose the winner of a ticket set by the rule `rule` of dpltm.selection.rules (None: the one the
    CLI's flags `best`/`noise_aware` name); `noise_aware` is also the planned run a rule may need."""
    from dpltm.checkpoint import load_ticket_set, save_atomic
    from dpltm.config import resolve_select_config
    from dpltm.outputs import check_writable, output_lock, prepare_output
    from dpltm.paths import default_checkpoint_dir
    from dpltm.selection.winner import make_winner, newest_ticket_set

    chosen_rule = selection_rule(rule or rule_for_flags(best, noise_aware is not None))
    settings = resolve_select_config(cli, config)
    source = tickets
    if source is None:
        source = newest_ticket_set(default_checkpoint_dir())
        err_console.print(f"using the newest ticket set in {default_checkpoint_dir()}/: {source} (--tickets to choose)")
    ticket_set = load_ticket_set(source)  # a winner is refused: it needs no selection
    if any(math.isnan(a) for a in ticket_set.accuracies):
        raise DpltmUserError(f"{source} holds tickets without a validation accuracy (generated with no validation "
                             "records), and every rule scores them by it: generate them again with a larger "
                             "--val-fraction")
    target = out or default_checkpoint_dir() / f"{ticket_set.dataset}-winner.pt"
    prepare_output(target, overwrite=overwrite, inputs=[source, config], checkpoint=True)
    chosen_eps1 = settings.eps1 if chosen_rule.spends_eps1 else None
    if chosen_rule.spends_eps1:  # the draw is recorded in the ticket file: it must be writable, said as such
        try:
            check_writable(source)
        except DpltmUserError as exc:
            raise DpltmUserError(f"{source}: a draw that spends ε1 is recorded in the ticket file, which cannot be "
                                 f"written ({exc}); copy it somewhere writable and select from the copy") from None
    check_halving(settings.halving, noise_aware=chosen_rule.needs_planned_run, name=chosen_rule.name)
    check_search(settings.search, noise_aware=chosen_rule.needs_planned_run, name=chosen_rule.name)
    rule_settings = RuleSettings(nu=settings.nu, seed=seed, eps1=chosen_eps1, planned_run=noise_aware, config=config,
                                 halving=settings.halving, search=settings.search)
    # A pick that spends no ε1 has no draw to record: it may take as long as it needs (noise-aware trains
    # candidates) before any lock is held. One that spends ε1 draws under the ticket set's lock, below.
    chosen = None if chosen_rule.spends_eps1 else chosen_rule.select(ticket_set, rule_settings)
    with contextlib.ExitStack() as stack:
        if chosen_rule.spends_eps1:  # the draw is recorded in the ticket file: lock it, re-read it
            stack.enter_context(output_lock(source))
            ticket_set = load_ticket_set(source)
            draws = ticket_set.draws
            if draws and not reselect:
                raise DpltmUserError(
                    f"{source} was already drawn from {len(draws)} time(s) (ε1 = {format_epsilon(sum(draws))} "
                    f"in all): another "
                    f"draw spends ε1 again on {ticket_set.dataset}; pass --reselect to draw again "
                    f"(the winner's ledger then composes every draw)")
        stack.enter_context(output_lock(target))
        if chosen is None:
            chosen = chosen_rule.select(ticket_set, rule_settings)
        selection = chosen.selection
        winner = make_winner(ticket_set, source, selection, eps1=chosen_eps1, nu=settings.nu,
                             seeded=seed is not None, method=chosen_rule.name, event=chosen.event)
        if chosen_eps1 is not None:  # recorded before the winner is released, so no draw goes uncounted
            ticket_set = replace(ticket_set, selection_draws=(*ticket_set.draws, chosen_eps1))
            save_atomic(ticket_set.to_dict(), source, "tickets")
        save_atomic(winner.to_dict(), target, "ticket")
    _print_selection(ticket_set, selection, chosen_rule, chosen_eps1, settings.nu)
    data = ticket_set.data
    spend = (chosen_rule.spend if not chosen_rule.spends_eps1 else
             f"spends ε1 = {format_epsilon(chosen_eps1)} on {data['dataset']} ({data['split']}), the data that "
             f"made the tickets"
             + (f"; {winner.selection['draws']} draws from this ticket set, ε1 = "
                f"{format_epsilon(winner.selection['eps1_total'])} in all" if winner.selection["draws"] > 1 else ""))
    err_console.print(f"winner: round {winner.round} (C = {winner.density:.4f}, "
                      f"A = {winner.val_accuracy:.4f}); selection {spend}")
    err_console.print(same_data_note(data), markup=False)
    err_console.print(f"ticket file: {target}")
    return winner, target
