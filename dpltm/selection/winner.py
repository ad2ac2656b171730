"""Phase 2: choose the winning ticket, by one of the rules of dpltm.selection.rules.

The rules' functions live here (`select_*`, `(TicketSet, RuleSettings) -> Selection`). The winner is
written as a 'ticket' file: θ0, its mask and C, where it came from, and how it was chosen (the rule,
ε1, ν, Δ, the probability table, the rule's DpEvent) so that training can state the guarantee; and,
where the ticket set kept them, the chosen round's trained weights (`public_weights`, for `train
--rewind public`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpltm import __version__
from dpltm.checkpoint import load_ticket_set
from dpltm.config import SEARCH_FIXED_BY
from dpltm.errors import DpltmUserError
from dpltm.masks import masked_weights
from dpltm.options import Overrides
from dpltm.privacy.display import format_sigma
from dpltm.privacy.events import event_to_json
from dpltm.privacy.exponential import (
    decisive_eps1,
    make_selection_rng,
    near_uniform,
    sample_exponential,
    score_sensitivity,
    selection_probabilities,
    ticket_scores,
)
from dpltm.selection.noise_aware import NoiseAwareChoice
from dpltm.selection.rules import RuleSettings, selection_rule
from dpltm.settings import canonical_start, describe_start

if TYPE_CHECKING:
    from dpltm.artefacts import TicketSet, Winner
    from dpltm.privacy.events import DpEvent


def newest_ticket_set(directory: Path) -> Path:
    """The most recently written ticket set in `directory` (what `select` uses by default)."""
    candidates = sorted(directory.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    passed_over: list[str] = []
    for path in candidates:
        try:
            load_ticket_set(path)
        except DpltmUserError as error:
            if "damaged" in str(error) or "not a readable" in str(error):
                passed_over.append(path.name)  # a ticket set's name, unreadable: say so rather than skip it unseen
            continue
        if passed_over:  # a newer file that may have been the ticket set meant: never fall back to an older one unseen
            raise DpltmUserError(f"{directory / passed_over[0]} is newer than the ticket set {path} but cannot be "
                                 "read (damaged?): pass --tickets to choose one")
        return path
    unreadable = f" ({', '.join(passed_over[:3])} could not be read: damaged?)" if passed_over else ""
    raise DpltmUserError(f"no ticket set in {directory}/{unreadable}: run `dpltm generate` first or pass --tickets")


@dataclass(frozen=True)
class Selection:
    index: int
    scores: np.ndarray
    probabilities: np.ndarray
    sensitivity: float
    near_uniform: bool
    decisive_eps1: float
    record: dict[str, Any] = field(default_factory=dict)
    """What the rule adds to the winner file's `selection` record (noise-aware: its candidates and plan)."""


def _scored(tickets: TicketSet, nu: float) -> tuple[np.ndarray, float]:
    """S = A·(1 − ν·C) per ticket and its sensitivity Δ (dpltm.privacy.exponential), of a complete set."""
    if not tickets.tickets:
        raise DpltmUserError("the ticket set holds no tickets")
    if not tickets.complete:
        raise DpltmUserError("the ticket set is incomplete: rerun `dpltm generate` to finish it")
    accuracies = np.array(tickets.accuracies, dtype=np.float64)
    densities = np.array([t.density for t in tickets.tickets], dtype=np.float64)
    return ticket_scores(accuracies, densities, nu), score_sensitivity(densities, nu)


def _certain(scores: np.ndarray, index: int, sensitivity: float) -> Selection:
    probabilities = np.zeros_like(scores)
    probabilities[index] = 1.0
    return Selection(index, scores, probabilities, sensitivity, False, float("nan"))


def select_exponential(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """The exponential mechanism over S (ε1-DP, McSherry & Talwar 2007, Thm 6; DPLTM eq. 2)."""
    scores, sensitivity = _scored(tickets, settings.nu)
    eps1 = float(settings.eps1)  # type: ignore[arg-type]  # the rule refuses None
    probs = selection_probabilities(scores, eps1, sensitivity)
    index = sample_exponential(scores, eps1, sensitivity, make_selection_rng(settings.seed))
    return Selection(index, scores, probs, sensitivity, near_uniform(probs), decisive_eps1(scores, sensitivity))


def select_best(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """The highest score (the paper's pick for public tickets): no privacy on the ticket data."""
    scores, sensitivity = _scored(tickets, settings.nu)
    return _certain(scores, int(np.argmax(scores)), sensitivity)


def select_random(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """A uniformly random ticket (the paper's Table 2 control): it never looks at the ticket data, so it
    spends nothing even on same-data tickets. The scores are shown, not used."""
    scores, sensitivity = _scored(tickets, settings.nu)
    k = len(scores)
    index = int(np.random.default_rng(settings.seed).integers(k))
    return Selection(index, scores, np.full(k, 1 / k), sensitivity, True, math.nan)


def select_noise_aware(tickets: TicketSet, settings: RuleSettings) -> Selection:
    """Train every candidate under the planned noise on the tickets' public data (dpltm.selection.noise_aware)
    and take the best public validation accuracy; spends no ε."""
    from dpltm.config import fixed_dimensions, resolve_train_config
    from dpltm.console import err_console
    from dpltm.devices import resolve_device
    from dpltm.dp.noise import noise_plugin
    from dpltm.progress import step_bar
    from dpltm.selection.noise_aware import PlannedRun, noise_aware_choice, rung_steps
    from dpltm.tickets.data import reload_ticket_data
    from dpltm.training.plan import plan_training

    request = settings.planned_run
    cfg = resolve_train_config(request.train_cli, settings.config)
    fixed = fixed_dimensions(request.train_cli, settings.config)
    search = tuple(d for d in settings.search if d not in fixed)
    s = cfg.train
    if not noise_plugin(s.noise).plain_norm:
        raise DpltmUserError(f"--noise-aware simulates Gaussian-type noise; with --noise {s.noise} use --best")
    plan = plan_training(s, request.private_size)
    planned = PlannedRun.of(s, plan, cfg.model.activation, request.private_size)
    public = reload_ticket_data(tickets, request.data_dir, resolve_device(request.device))
    batch, sigma = planned.on_public(len(public.train))
    rungs = rung_steps(plan.steps, settings.halving) if len(tickets.tickets) > 2 else []
    if settings.halving and len(rungs) < settings.halving:
        err_console.print(f"note: --halving {settings.halving}: " + (
            f"{len(rungs)} rung(s) fit {plan.steps} steps" if len(tickets.tickets) > 2
            else "with under 3 candidates there is nothing to halve"), markup=False, highlight=False)
    trained = (f"each trained {plan.steps} steps" if not rungs else
               f"trained up to {plan.steps} steps, halved after steps {', '.join(map(str, rungs))} while over two "
               "remain (successive halving: the dense network and the better half of the tickets go on)")
    err_console.print(f"noise-aware choice: {len(tickets.tickets)} candidates (dense included), {trained}"
                      f" under σ = {format_sigma(sigma)}, L = {batch} on {public.name} ({public.source_split} "
                      f"split, the tickets' public data): the private run's {plan.epochs} epochs and noise per step "
                      f"σ/L = {format_sigma(plan.noise_multiplier / plan.expected_batch_size, 3)}; spends no ε")
    for dimension in settings.search:
        if dimension in fixed:
            err_console.print(f"note: --search {dimension}: not searched, the {fixed[dimension]} setting given "
                              "fixes it", markup=False, highlight=False)
    if "freeze" in search:
        from dpltm.networks.lenet import Architecture
        from dpltm.selection.noise_aware import freezable_first_layer

        if freezable_first_layer(Architecture.from_dict(tickets.architecture)) is None:
            err_console.print("note: --search freeze: the network has one trained layer, nothing to freeze",
                              markup=False, highlight=False)
        elif "start" not in search and s.rewind == "init":
            err_console.print("note: --search freeze: the start is fixed at θ0, and a layer frozen there would hold "
                              "random weights: no frozen variant", markup=False, highlight=False)
        elif "start" not in search and s.rewind != "public":
            err_console.print(f"note: --search freeze: the start is fixed at θ_{s.rewind}, and a frozen variant holds "
                              "a layer at its public-trained weights: no frozen variant (search start too, or "
                              "give --freeze)", markup=False, highlight=False)
    if search:
        err_console.print(f"noise-aware choice also searches: {', '.join(search)} (a variant replaces the planned run "
                          "only if it beats the dense network as planned by two standard errors)",
                          markup=False, highlight=False)
    with step_bar("noise-aware choice", plan.steps, enabled=request.progress) as bar:
        choice = noise_aware_choice(tickets, public, planned, seed=settings.seed, halving=settings.halving,
                                    search=search, on_progress=lambda done, _: bar.update(done - bar.n))
    return noise_aware_selection(choice)


CHOSEN_KEYS = {**SEARCH_FIXED_BY, "freeze": (*SEARCH_FIXED_BY["freeze"], *SEARCH_FIXED_BY["start"])}
"""The `train:` settings a searched dimension sets: those that fix it (dpltm.config.SEARCH_FIXED_BY), and for
`freeze` the start too (a frozen variant is defined at the public start)."""


def chosen_training(selection: Mapping[str, Any] | None) -> Overrides | None:
    """The `train:` settings of the variant the noise-aware choice of a winner (its `selection` record) chose, for
    the dimensions it searched only (`NoiseAwareChoice.chosen`, `searched`), which `train` puts under the --config
    file and flags; None where the choice searched nothing (or the winner was picked otherwise). A damaged record
    is refused in one line."""
    from dpltm.settings import OUTPUT_LAYERS, SEARCHABLE

    choice = None if selection is None else selection.get("noise_aware")
    chosen = choice.get("chosen") if isinstance(choice, dict) else None
    if chosen is None:
        return None
    searched = choice.get("searched")
    ema = chosen.get("ema") if isinstance(chosen, dict) else None
    sound = (isinstance(chosen, dict) and set(chosen) == {"start", "freeze", "ema", "ema_warmup", "output_layer"}
             and isinstance(searched, list) and bool(searched) and set(searched) <= set(SEARCHABLE)
             and _is_start(chosen["start"]) and chosen["output_layer"] in OUTPUT_LAYERS
             and isinstance(chosen["freeze"], (list, tuple)) and all(isinstance(n, str) and n for n in chosen["freeze"])
             and (ema is None or (isinstance(ema, float) and 0.0 < ema < 1.0))
             and isinstance(chosen["ema_warmup"], bool) and not (chosen["ema_warmup"] and ema is None))
    if not sound:
        raise DpltmUserError("the winner's record of its noise-aware choice is damaged (its chosen variant): "
                             "select again")
    values = {"rewind": chosen["start"], "output_layer": chosen["output_layer"], "freeze": list(chosen["freeze"]),
              "ema": ema, "ema_warmup": chosen["ema_warmup"]}
    keys = {key for dimension in searched for key in CHOSEN_KEYS[dimension]}
    return Overrides({f"train.{key}": values[key] for key in values if key in keys})


def _is_start(start: Any) -> bool:
    """Whether a recorded start is one `train --rewind` takes (init, public or a step K), as written: a string in
    its canonical form (`canonical_start`), so the run's start and the chosen one compare equal."""
    try:
        return isinstance(start, str) and canonical_start(start) == start
    except DpltmUserError:
        return False


def describe_variant(train: Mapping[str, Any]) -> str:
    """A variant's `train:` settings (those given) in words."""
    parts = []
    if "rewind" in train:
        parts.append("start from " + describe_start(train["rewind"]))
    if "freeze" in train:
        parts.append(f"{', '.join(train['freeze'])} frozen" if train["freeze"] else "no layer frozen")
    if "ema" in train:
        parts.append("release " + ("the final iterate" if train["ema"] is None else
                                   f"an EMA of decay {train['ema']:g}" + (" with warm-up" if train.get("ema_warmup")
                                                                          else "")))
    return ", ".join(parts)


def choose(tickets: TicketSet, *, eps1: float | None, nu: float, seed: int | None) -> Selection:
    """Score S = A·(1 − ν·C) per ticket; sample with the exponential mechanism, or argmax (`eps1` None)."""
    rule = selection_rule("best" if eps1 is None else "exponential")
    return rule.select(tickets, RuleSettings(nu=nu, seed=seed, eps1=eps1)).selection


def noise_aware_selection(choice: NoiseAwareChoice) -> Selection:
    """A noise-aware pick as a `Selection`: its scores are the public accuracies under the planned noise."""
    scores = np.array(choice.ticket_scores(), dtype=np.float64)
    return replace(_certain(scores, choice.index, float("nan")), record={"noise_aware": choice.to_json()})


def make_winner(tickets: TicketSet, source: Path, selection: Selection, *,
                eps1: float | None, nu: float, seeded: bool,
                noise_aware: NoiseAwareChoice | None = None, method: str | None = None,
                event: DpEvent | None = None) -> Winner:
    """The winner of `tickets`, checked as its file will be read. An exponential draw composes with every
    earlier draw from the same ticket set (`draws`, `eps1_total`): each released winner is a function of all
    of them. `method` and `event` are the rule's name and DpEvent (`SelectionRule.select`); without them
    they are inferred (exponential when `eps1` is given, noise-aware with `noise_aware`, else best)."""
    from dpltm.artefacts import Winner

    ticket = tickets.tickets[selection.index]
    if method is None:
        method = "exponential" if eps1 is not None else ("noise-aware" if noise_aware is not None else "best")
    if event is None:
        event = selection_rule(method).event(eps1)
    record = selection.record or ({} if noise_aware is None else {"noise_aware": noise_aware.to_json()})
    earlier = tickets.draws if eps1 is not None else ()
    chosen = {
        "method": method,
        "eps1": eps1,
        "draws": len(earlier) + 1 if eps1 is not None else 0,
        "eps1_total": sum(earlier) + eps1 if eps1 is not None else None,
        "nu": nu,
        "sensitivity": selection.sensitivity,
        "scores": selection.scores.tolist(),
        "probabilities": selection.probabilities.tolist(),
        "near_uniform": selection.near_uniform,
        "randomness": "seeded (reproducible; not secret)" if seeded else "OS CSPRNG",
        "dp_event": event_to_json(event),
        "noise_aware": None,
    }
    clash = sorted(set(record) & set(chosen) - {"noise_aware"})
    if clash:  # a rule's record must never overwrite what the ledger and the statement read
        raise ValueError(f"the {method} rule's record would overwrite the winner file's {clash}")
    point = tickets.rewind_point  # late rewinding: θ_K under this ticket's mask, where `train --rewind K` starts
    return Winner.from_payload({
        "dpltm_version": __version__, "architecture": tickets.architecture, "theta0": tickets.theta0,
        "masks": ticket.masks, "density": ticket.density, "layer_density": ticket.layer_density,
        "round": ticket.round, "val_accuracy": ticket.val_accuracy,
        "source": {"tickets": str(source), "data": tickets.data, "config": tickets.config},
        "privacy": tickets.privacy.to_dict(), "selection": {**chosen, **record},
        "public_weights": ticket.trained,  # the round's trained weights (older ticket sets kept none)
        "rewind_point": None if point is None else {"step": point.step,
                                                    "weights": masked_weights(point.weights, ticket.masks)}})
