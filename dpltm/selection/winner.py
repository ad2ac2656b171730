"""Phase 2: choose the winning ticket (exponential mechanism, or a non-private best pick).

The winner is written as a 'ticket' file: θ0, its mask and C, where it came from, and how it
was chosen (ε1, ν, Δ, the probability table) so that training can state the guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dp_accounting import NonPrivateDpEvent  # type: ignore[import-untyped]

from dpltm import __version__
from dpltm.checkpoint import load_checkpoint
from dpltm.errors import DpltmUserError
from dpltm.privacy.events import event_to_json, selection_event
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


def newest_ticket_set(directory: Path) -> Path:
    """The most recently written ticket set in `directory` (what `select` uses by default)."""
    candidates = sorted(directory.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            load_checkpoint(path, "tickets")
        except DpltmUserError:
            continue
        return path
    raise DpltmUserError(f"no ticket set in {directory}/: run `dpltm generate` first or pass --tickets")


@dataclass(frozen=True)
class Selection:
    index: int
    scores: np.ndarray
    probabilities: np.ndarray
    sensitivity: float
    near_uniform: bool
    decisive_eps1: float


def choose(payload: dict[str, Any], *, eps1: float | None, nu: float, seed: int | None) -> Selection:
    """Score S = A·(1 − ν·C) per ticket; sample with the exponential mechanism, or argmax."""
    tickets = payload["tickets"]
    if not tickets:
        raise DpltmUserError("the ticket set holds no tickets")
    if not payload.get("complete", False):
        raise DpltmUserError("the ticket set is incomplete: rerun `dpltm generate` to finish it")
    accuracies = np.array([t["val_accuracy"] for t in tickets], dtype=np.float64)
    densities = np.array([t["density"] for t in tickets], dtype=np.float64)
    scores = ticket_scores(accuracies, densities, nu)
    sensitivity = score_sensitivity(densities, nu)
    if eps1 is None:
        best = int(np.argmax(scores))
        probs = np.zeros_like(scores)
        probs[best] = 1.0
        return Selection(best, scores, probs, sensitivity, False, float("nan"))
    probs = selection_probabilities(scores, eps1, sensitivity)
    index = sample_exponential(scores, eps1, sensitivity, make_selection_rng(seed))
    return Selection(index, scores, probs, sensitivity, near_uniform(probs),
                     decisive_eps1(scores, sensitivity))


def previous_draws(payload: dict[str, Any]) -> list[float]:
    """ε1 of every exponential-mechanism draw already made from this ticket set (recorded in it)."""
    draws = payload.get("selection_draws", [])
    if not isinstance(draws, list) or not all(isinstance(e, (int, float)) and e > 0 for e in draws):
        raise DpltmUserError("the ticket set's record of earlier selections is damaged")
    return [float(e) for e in draws]


def noise_aware_selection(choice: NoiseAwareChoice) -> Selection:
    """A noise-aware pick as a `Selection`: its scores are the public accuracies under the planned noise."""
    scores = np.array([c.public_val_accuracy for c in choice.candidates], dtype=np.float64)
    probabilities = np.zeros_like(scores)
    probabilities[choice.index] = 1.0
    return Selection(choice.index, scores, probabilities, float("nan"), False, float("nan"))


def winner_payload(payload: dict[str, Any], source: Path, selection: Selection, *,
                   eps1: float | None, nu: float, seeded: bool,
                   noise_aware: NoiseAwareChoice | None = None) -> dict[str, Any]:
    """The winner file. An exponential draw composes with every earlier draw from the same ticket
    set (`draws`, `eps1_total`): each released winner is a function of all of them."""
    ticket = payload["tickets"][selection.index]
    method = "exponential" if eps1 is not None else ("noise-aware" if noise_aware is not None else "best")
    earlier = previous_draws(payload) if eps1 is not None else []
    return {
        "dpltm_version": __version__,
        "architecture": payload["architecture"],
        "theta0": payload["theta0"],
        "masks": ticket["masks"],
        "density": ticket["density"],
        "layer_density": ticket["layer_density"],
        "round": ticket["round"],
        "val_accuracy": ticket["val_accuracy"],
        "source": {"tickets": str(source), "data": payload["data"], "config": payload["config"]},
        "privacy": payload["privacy"],
        "selection": {
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
            "dp_event": event_to_json(selection_event(eps1) if eps1 is not None else NonPrivateDpEvent()),
            "noise_aware": None if noise_aware is None else noise_aware.to_json(),
        },
    }
