"""Resuming a saved `make_private` run: the model, optimiser and spent segments of the file, each checked
against the others, so that a resumed run never states less ε than was spent."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dpltm.api_checks import Provenance, check_budget_left, user_path
from dpltm.errors import DpltmUserError
from dpltm.privacy.segments import SpentSegments
from dpltm.training.plan import EpochRecord
from dpltm.user_inputs import Masks, user_run_ledger
from dpltm.weight_guard import _held_entries, _renote


@dataclass(frozen=True)
class RunProvenance(Provenance):
    """A `make_private` run's provenance, and the noise filter its optimiser read (a resume must filter on)."""

    noise_filter: str

    @classmethod
    def saved(cls, body: Mapping[str, Any]) -> RunProvenance:
        """As a run file stores it (`PrivateTraining.state_dict`), the values as read."""
        settings = body["settings"] if isinstance(body["settings"], dict) else {}
        return cls(body.get("masks_private"), body.get("selection_eps1"), settings.get("neighboring"),
                   settings.get("noise_filter", "none"))


@dataclass(frozen=True)
class ResumedRun:
    """What a resumed run brings from its file (`resume_run`): the segments spent, the epochs `fit` finished and
    their records, and the steps of the run's schedule taken. A fresh run's is empty."""

    segments: SpentSegments = field(default_factory=SpentSegments)
    epochs_done: int = 0
    history: list[EpochRecord] = field(default_factory=list)
    steps_before: int = 0
    noise_filter: Mapping[str, Any] | None = None
    """The noise filter's history as saved (`NoiseFilter.state_dict`): the resumed run filters on from it."""


def _epochs_run(segments: SpentSegments) -> float:
    """The epochs the spent segments ran: each ran steps / ⌈N/L_i⌉ at its own L_i (a resume may change L). Steps
    taken outside fit() (saved mid-epoch) count too."""
    return sum(r["steps"] / math.ceil(r["dataset_size"] / r["expected_batch_size"]) for r in segments.records())


def _schedule_steps_done(segments: SpentSegments, dataset_size: int, batch_size: int) -> int:
    """`_epochs_run` in steps of an epoch of ⌈N/L⌉ at this `batch_size`, rounded up: the resumed plan covers what is
    left of the run's epochs and never goes past them (it may stop short of them by under a step)."""
    return math.ceil(_epochs_run(segments) * math.ceil(dataset_size / batch_size) - 1e-9)


def _resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, masks: Masks,
            dataset_size: int, provenance: RunProvenance) -> tuple[SpentSegments, int, list[EpochRecord],
                                                                   Mapping[str, Any] | None]:
    """Model, optimiser and the spent segments of a saved run; the data, masks, optimiser class and the
    run's privacy provenance must be the run's: a resume that dropped `masks_private=True` or an ε1 would
    state a smaller ε than was spent."""
    from dpltm.checkpoint import load_checkpoint

    body = load_checkpoint(path, "run")
    saved_settings = body["settings"] if isinstance(body["settings"], dict) else {}
    differ = RunProvenance.saved(body).differences(provenance)
    if differ:
        raise DpltmUserError(f"the run in {path} was made with {differ}: resume with the same values")
    if body.get("optimizer_class") not in (None, type(optimizer).__name__):
        raise DpltmUserError(f"the run in {path} used {body['optimizer_class']}, not {type(optimizer).__name__}: "
                             "resume with the same optimizer class")
    if body["dataset_size"] != dataset_size:
        raise DpltmUserError(f"{path} trained on {body['dataset_size']} records, this data has {dataset_size}: "
                             "resume on the same private data")
    saved = {k: torch.as_tensor(v) for k, v in body["masks"].items()}
    if set(saved) != set(masks) or any(not torch.equal(saved[k].bool().cpu(), masks[k].cpu()) for k in masks):
        raise DpltmUserError(f"the masks differ from those of the run in {path}: pass the same masks")
    segments, epochs_done, history = _spent_record(path, body, saved, saved_settings)
    try:
        model.load_state_dict(body["model"])
        optimizer.load_state_dict(body["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DpltmUserError(f"{path} does not fit this model or optimizer: {first}") from None
    stored_filter = body.get("noise_filter")
    return segments, epochs_done, history, stored_filter if isinstance(stored_filter, dict) else None


def _spent_record(path: Path, body: Mapping[str, Any], masks: Mapping[str, Tensor],
                  settings: Mapping[str, Any]) -> tuple[SpentSegments, int, list[EpochRecord]]:
    """The saved run's spent segments, epoch count and history, each checked against the others and against the
    privacy record saved beside them: a resume composes its budget with these segments, so a file whose segments
    were emptied or shortened while its ledger still records the steps would state a smaller ε than was spent.
    A file edited consistently in all four places is not caught (that would need a keyed MAC: docs/privacy.md §8)."""
    segments = SpentSegments(body["segments"])
    epochs_done, history = body["epochs_done"], body["history"]
    if (isinstance(epochs_done, bool) or not isinstance(epochs_done, int) or epochs_done < 0
            or not isinstance(history, list) or len(history) != epochs_done
            or not all(isinstance(r, dict) and isinstance(r.get("steps"), int) for r in history)
            or (history and not history[-1]["steps"] <= segments.steps)):
        raise DpltmUserError(f"{path}: its epochs_done, history and spent segments disagree (an altered file): "
                             "refusing to resume from it")
    try:
        rebuilt = user_run_ledger(segments, settings.get("delta"), settings.get("accountant"),  # type: ignore[arg-type]
                                  settings.get("neighboring"), masks, body.get("masks_from"),  # type: ignore[arg-type]
                                  bool(body.get("masks_private")), body.get("selection_eps1"),
                                  body.get("dataset_name"))  # type: ignore[arg-type]
        stored = body.get("ledger")
        fields = None if rebuilt is None else {k: v for k, v in rebuilt.to_json().items() if k != "format_version"}
        agrees = fields == (None if stored is None else {k: v for k, v in stored.items() if k != "format_version"})
    except (DpltmUserError, TypeError, ValueError):
        agrees = False
    if not agrees:
        raise DpltmUserError(f"{path}: its spent segments disagree with the privacy record saved beside them (an "
                             "altered file): refusing to resume from it")
    return segments, epochs_done, list(history)


def resume_run(resume_from: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, masks: Masks, *,
               noise_seed: int | None, dataset_size: int, batch_size: int, epochs: int, provenance: RunProvenance,
               target_epsilon: float | None, delta: float, accountant: str) -> ResumedRun:
    """The saved run's spent segments, epochs, history, the steps of the schedule it took and its noise filter's
    history, with its model and optimiser loaded; a refused resume leaves the model and optimiser as they were."""
    if noise_seed is not None:
        raise DpltmUserError("noise_seed cannot be combined with resume_from: a resumed run draws fresh OS "
                             "randomness (re-seeding would reuse the first segment's noise)")
    resume_from = user_path(resume_from, "resume_from")
    before = ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict()))
    guarded = _held_entries(model)
    try:
        segments, epochs_done, history, noise_filter = _resume(Path(resume_from), model, optimizer, masks,
                                                               dataset_size, provenance)
        check_budget_left(segments.events(), target_epsilon, delta, accountant, provenance.neighboring,
                          provenance.selection_eps1)
        steps_before = _schedule_steps_done(segments, dataset_size, batch_size)
        if steps_before >= epochs * math.ceil(dataset_size / batch_size):
            run_so_far = _epochs_run(segments)
            short = (f", and a step at batch_size={batch_size} is more than the rest" if run_so_far < epochs
                     else "")
            raise DpltmUserError(f"the run in {resume_from} has done {run_so_far:.4g} of epochs={epochs}{short}: "
                                 "pass a larger epochs to train on")
    except DpltmUserError:  # a refused resume leaves the model and optimiser as they were
        model.load_state_dict(before[0])
        optimizer.load_state_dict(before[1])
        _renote(model, guarded)  # the same weights again: still another run's (restoring moved the counters)
        raise
    return ResumedRun(segments, epochs_done, history, steps_before, noise_filter)
