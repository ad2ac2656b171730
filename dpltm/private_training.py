"""PrivateTraining: a user's model under dpltm's masked DP-SGD, stepped from its own Poisson sampler."""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from dpltm.api_checks import (
    check_callable,
    check_class_labels,
    check_count,
    check_data_fits_model,
    check_finite,
    check_flag,
    check_token_ids,
    user_path,
)
from dpltm.dp.distributed import rank_sampling_seed
from dpltm.dp.engine import Loss, RecordTable, per_sample_cross_entropy, record_norm_tables
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.independence import (
    check_samples_independent,
    module_modes,
    probe_rows,
)
from dpltm.dp.noise_filter import NoiseFilter, make_noise_filter
from dpltm.dp.sampling import poisson_sample
from dpltm.dp.step import DpSgdStep, EngineLayout, check_steps_left
from dpltm.errors import DpltmUserError
from dpltm.privacy.accounting import check_delta
from dpltm.privacy.ledger import PrivacyLedger, before_any_step, json_float
from dpltm.privacy.segments import SpentSegments
from dpltm.private_records import DatasetRecords, Records, TensorRecords
from dpltm.run_resume import ResumedRun
from dpltm.settings import TrainSettings
from dpltm.training.plan import EpochRecord, TrainPlan
from dpltm.user_inputs import (
    Data,
    Masks,
    apply_masks,
    as_tensors,
    evaluate,
    model_tensors,
    record_keys,
    user_run_ledger,
)
from dpltm.weight_guard import check_not_trained_elsewhere, note_private_step

RECORDS_COPY_MAX_BYTES = 4 << 30
"""Tensor records up to this size get per-record norm tables (`PrivateTraining._record_tables`, which
keeps its own copy of them); larger ones compute every norm per batch."""


def restored_noise_filter(name: str, model: nn.Module, state: Mapping[str, Any] | None,
                          refusal: str) -> NoiseFilter | None:
    """The run's noise filter over `model`'s trainable parameters (None for `none`), continuing from the saved
    history `state` where there is one; `refusal` opens the one-line error for a state that does not fit."""
    noise_filter = make_noise_filter(name, {n: p for n, p in model.named_parameters() if p.requires_grad})
    if noise_filter is not None and state is not None:
        try:
            noise_filter.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as error:
            raise DpltmUserError(f"{refusal}: {error}") from None
    return noise_filter


class LedgerReadout:
    """ε read from a run's ledger, as Opacus's `get_epsilon(delta)`: what `PrivateTraining` and `DPCallback` share.
    `_raw_steps` counts optimiser steps on gradients the run did not privatise: any, and the run is not DP."""

    segments: SpentSegments
    _raw_steps = 0

    def ledger(self) -> PrivacyLedger | None:
        raise NotImplementedError

    def before_any_step(self) -> tuple[float, str]:
        """ε and statement while `ledger()` is None (`dpltm.privacy.ledger.before_any_step`)."""
        raise NotImplementedError

    @property
    def steps_done(self) -> int:
        """Every DP step this run has taken, earlier segments (before a resume) included."""
        return self.segments.steps

    @property
    def epsilon(self) -> float:
        """The run's ε so far, by the accountant the plan was calibrated with (before the first step: the ε1 of
        choosing its ticket, else 0); ∞ when the masks came from these private records (`masks_private`): not DP
        end to end."""
        return self.get_epsilon()

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε so far at `delta` (None: the run's δ): the same segments and accountant, read at another point of
        their privacy curve."""
        if delta is not None:
            delta = check_delta(delta)
        if self._raw_steps:
            return math.inf
        ledger = self.ledger()
        return self.before_any_step()[0] if ledger is None else ledger.get_epsilon(delta)


class PrivateTraining(LedgerReadout):
    """A user's model under dpltm's masked DP-SGD. Build it with `make_private` (or resume one with
    `make_private(..., resume_from=path)`).

    Every step draws its own batch from the run's Poisson sampler (each record in with probability
    q = L/N, from a generator seeded by the OS CSPRNG): `step()` takes no data, so no batch chosen
    any other way can be booked as a Poisson step (docs/privacy.md §8)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, records: Records, plan: TrainPlan,
                 settings: TrainSettings, masks: Masks, masks_from: str | None, loss: Loss,
                 seed: int, dataset_name: str, masks_private: bool = False,
                 selection_eps1: float | None = None, resumed: ResumedRun | None = None,
                 layer_clips: dict[str, float] | None = None, max_physical_batch_size: int | None = None) -> None:
        """`layer_clips`: per-layer bounds C_l (`api_checks.layer_clip_bounds`), `settings.clip` then being
        √(Σ C_l²), the sensitivity the noise and the ledger use; None: one flat bound, `settings.clip`."""
        self.model, self.optimizer, self.records = model, optimizer, records
        self._plan, self._settings = plan, settings  # read-only: the ledger's segment is what steps run at
        self.masks, self.masks_from, self.loss = masks, masks_from, loss
        self._training_keys: np.ndarray | None = None  # content hashes of the training records, made when first needed
        self.dataset_name = dataset_name
        self._masks_private, self._selection_eps1 = masks_private, selection_eps1
        resumed = resumed if resumed is not None else ResumedRun()
        self._filter = restored_noise_filter(settings.noise_filter, model, resumed.noise_filter,
                                             "the saved run's noise filter does not fit this model")
        self._layout = EngineLayout.of(model, masks)  # its masks float: re-masking converts nothing
        self._dp = DpSgdStep(model, self._layout, settings.clip,
                             GaussianNoise(plan.noise_multiplier), plan.expected_batch_size,
                             torch.Generator(device=records.device).manual_seed(seed), optimizer, loss,
                             max_physical_batch_size=max_physical_batch_size, before_update=self._book_step,
                             after_update=self._after_update, layer_clips=layer_clips, noise_filter=self._filter)
        # one sampling stream for the whole run, apart from the noise's: every step draws a fresh batch
        self._sampling_generator = torch.Generator(device=records.device).manual_seed(rank_sampling_seed(seed, 0))
        self.segments = resumed.segments
        self.segments.begin(plan.sample_rate, plan.noise_multiplier, settings.clip, plan.expected_batch_size,
                            plan.dataset_size)
        self.epochs_done = resumed.epochs_done  # the epochs fit() finished and recorded (the length of `history`)
        self.history: list[EpochRecord] = list(resumed.history)
        self._in_step = False
        self._classes: int | None | Literal[False] = False  # a read batch's label bound (`_check_read_batch`)
        self._tables: dict[str, RecordTable] | None = None  # made at the first step (`_record_tables`)
        self._tables_version = -1
        self._probed_modes = {module_modes(model)}  # make_private probed the model as it is now
        _guard_optimizer(optimizer, self)

    @property
    def plan(self) -> TrainPlan:
        """The open segment's plan (q, σ, steps): read-only, since every step must run at what the ledger
        records."""
        return self._plan

    @property
    def settings(self) -> TrainSettings:
        return self._settings

    @property
    def masks_private(self) -> bool:
        """The masks came from these private records: the run is not DP end to end (read-only)."""
        return self._masks_private

    @property
    def selection_eps1(self) -> float | None:
        """ε1 spent choosing the ticket, composed into every ε (read-only)."""
        return self._selection_eps1

    def batches(self, *args: Any, **kwargs: Any) -> None:
        raise DpltmUserError("PrivateTraining.batches() is gone: step() draws its own Poisson batch (a batch "
                             "chosen any other way is not the mechanism the accountant assumes); call "
                             "private.step() plan.steps_per_epoch times, or fit()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        """One DP-SGD step: draw a Poisson batch from the run's own sampler, masked clipped sum + noise on
        the surviving coordinates, divided by the expected batch size L, then the optimiser."""
        if args or kwargs:
            raise DpltmUserError("step() takes no batch: it draws its own Poisson batch (each record with "
                                 "probability q), the only batches the accountant covers")
        plan = self._plan
        check_steps_left(self.segments.open_steps, plan.steps)
        owner = _OWNERS.get(self.optimizer)
        if owner is None or owner() is not self:  # a resume took the optimizer (and the run) over
            raise DpltmUserError("this run's optimizer now belongs to a newer private run (a resume of it): continue "
                                 "with that one")
        check_not_trained_elsewhere(self.model, self)  # another run stepped these weights since this one did
        self._check_modes()
        index = poisson_sample(len(self.records), plan.sample_rate, self._sampling_generator, self.records.device)
        x, y = self.records.batch(index)
        if isinstance(self.records, DatasetRecords) and len(y):  # records in memory were checked whole by make_private
            self._check_read_batch(x, y)
        self._dp.step(x, y, index, terms=self._record_tables())

    def _check_read_batch(self, x: Tensor, y: Tensor) -> None:
        """A batch read from the dataset: its token ids and class labels fit the model. The model's classes come
        from one forward pass on the first batch's first record, once; later batches are checked without one."""
        what = "a batch of the training dataset (the step was not taken)"
        if self._classes is False:
            self._classes = check_data_fits_model(self.model, x, y, self.loss is per_sample_cross_entropy, what)
            return
        check_token_ids(self.model, x, what)
        if self._classes is not None:
            check_class_labels(y, self._classes, what)

    def _book_step(self) -> None:
        """The ledger counts the step, and the optimiser's guard lets this one update through."""
        self.segments.count_step()
        self._in_step = True

    def _after_update(self) -> None:
        """Interrupted too: the weights may have moved, and they are this run's."""
        self._in_step = False
        apply_masks(self.model, self._layout.masks)  # pruned weights stay exactly zero whatever the optimiser does
        note_private_step(self.model, self)

    def _check_modes(self) -> None:
        """The independence probe again whenever the modules are in modes not probed yet (`model.train()` after
        make_private saw it in eval mode): a layer may mix records only in training mode."""
        modes = module_modes(self.model)
        if modes in self._probed_modes:
            return
        first_x, _ = self.records.batch(torch.zeros(1, dtype=torch.long, device=self.records.device))
        check_samples_independent(self.model, first_x, rows=probe_rows(self._plan.expected_batch_size))
        self._probed_modes.add(modes)

    def _record_tables(self) -> dict[str, RecordTable] | None:
        """The per-record norm tables (dpltm.dp.engine.record_norm_tables) of records held as one tensor,
        whose rows the step takes for its batch. The tables must describe exactly the rows sampled: they are made from a
        private copy of the records, which then replaces them (the caller's tensor, or a NumPy array
        under it, could be written to without this object knowing); remade if its version counter moves."""
        features = getattr(self.records, "features", None)
        if not isinstance(features, Tensor) or features.numel() * features.element_size() > RECORDS_COPY_MAX_BYTES:
            return None
        if self._tables is None or self._tables_version != features._version:
            copy = features.clone()
            self._tables = record_norm_tables(self.model, self._dp.layout.masks, copy)
            if self._tables:  # kept only where a table reads it
                self.records.features = features = copy  # type: ignore[union-attr]
            self._tables_version = features._version
        return self._tables or None

    def fit(self, epochs: int | None = None, val: Data | None = None,
            on_epoch: Callable[[EpochRecord], None] | None = None) -> list[EpochRecord]:
        """Run the planned epochs (or `epochs` of them); returns one record per epoch with ε so far."""
        check_callable(on_epoch, "on_epoch")
        per_epoch = self.plan.steps_per_epoch
        position = self._schedule_position()
        left = self.plan.epochs - position // per_epoch  # an epoch begun (steps taken by hand) counts as one
        todo = left if epochs is None else check_count(epochs, "epochs", minimum=0)
        if todo > left:  # before any step: the budget was planned for the run's epochs
            raise DpltmUserError(f"fit(epochs={todo}): only {left} of the run's planned epochs are left (σ was "
                                 "calibrated for them); start a new run, or resume this one with a larger epochs")
        if val is not None:  # a wrong validation set fails now, not after an epoch of private steps
            val_x, val_y = model_tensors(self.model, val, next(self.model.parameters()).device)
            check_finite(val_x, "the validation features")
            check_data_fits_model(self.model, val_x, val_y, classification=True, what="the validation data")
            self._warn_if_training_records(val)
        for _ in range(todo):
            for _ in range(per_epoch - self._schedule_position() % per_epoch):  # to the end of the current epoch
                self.step()
            self.epochs_done += 1
            record: EpochRecord = {"epoch": self._schedule_position() // per_epoch, "steps": self.steps_done,
                      "epsilon": self.epsilon}
            if val is not None:
                record["val_accuracy"] = evaluate(self.model, val)
            self.history.append(record)
            if on_epoch is not None:
                on_epoch(record)
        return self.history

    def _schedule_position(self) -> int:
        """Steps into the run's `epochs` epochs: those of earlier segments (`plan.steps_before`) and this one's."""
        return self.plan.steps_before + self.segments.open_steps

    def evaluate(self, data: Data) -> float:
        """Top-1 accuracy on `data`: not private (warned when it holds private training records)."""
        self._warn_if_training_records(data)
        return evaluate(self.model, data)

    def _warn_if_training_records(self, data: Data) -> None:
        """Accuracy measured on private training records is a statistic of them released without noise."""
        if not isinstance(self.records, TensorRecords):
            return
        if self._training_keys is None:
            self._training_keys = record_keys(self.records.features, self.records.labels)
        try:
            keys = record_keys(*as_tensors(data, "cpu"))
        except (DpltmUserError, RuntimeError, TypeError, ValueError):
            return  # evaluate gives the one-line error
        shared = int(np.isin(keys, self._training_keys).sum())
        if shared:
            warnings.warn(f"{shared} of the {len(keys)} evaluation records are private training records: their "
                          "accuracy is not differentially private (evaluate on held-out or public data)",
                          stacklevel=3)

    def ledger(self) -> PrivacyLedger | None:
        """What ran on the private data so far (every (q, σ, steps) segment, δ) and the mask's provenance;
        None before the first step."""
        return user_run_ledger(self.segments, self.settings.delta, self.settings.accountant,
                               self.settings.neighboring, self.masks if self.masks_from else {}, self.masks_from,
                               self.masks_private, self.selection_eps1, self.dataset_name)

    def before_any_step(self) -> tuple[float, str]:
        return before_any_step(bool(self.masks_from and self.masks), self.masks_private, self.selection_eps1)

    @property
    def epsilon_dp_part(self) -> float:
        """ε of the DP phases alone (selection and training), even when the run is not DP end to end."""
        ledger = self.ledger()
        return float(self.selection_eps1 or 0.0) if ledger is None else ledger.best_bound().epsilon

    def report(self) -> dict[str, Any]:
        """The ledger's JSON report (ε, δ, accountant, what ran) and its plain-English statement."""
        ledger = self.ledger()
        if ledger is None:  # the ledger report's keys that apply: ε of the DP phases, the whole run's, scope
            overall, statement = self.before_any_step()
            return {"epsilon": self.epsilon_dp_part, "overall_epsilon": json_float(overall),
                    "end_to_end_dp": math.isfinite(overall), "steps": 0, "statement": statement}
        return {**ledger.report(), "statement": ledger.statement()}

    # ---- saving and resuming: what was spent travels, never a seed or a generator state -------
    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser, masks, the spent segments and the settings: everything to resume and to
        account, and nothing that would let anyone subtract the noise (no seed, no generator state)."""
        ledger = self.ledger()
        s = self.settings
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "masks": {k: v.cpu() for k, v in self.masks.items()},
            "masks_from": self.masks_from, "masks_private": self.masks_private,
            "selection_eps1": self.selection_eps1, "dataset_name": self.dataset_name,
            "dataset_size": len(self.records),
            "settings": {"epochs": s.epochs, "batch_size": s.batch_size, "clip": s.clip, "eps2": s.eps2,
                         "sigma": s.sigma, "delta": s.delta, "accountant": s.accountant,
                         "neighboring": s.neighboring,
                         **({"noise_filter": s.noise_filter} if self._filter is not None else {})},
            "segments": self.segments.state(), "epochs_done": self.epochs_done, "history": list(self.history),
            "optimizer_class": type(self.optimizer).__name__,
            "ledger": None if ledger is None else ledger.to_json(),
            **({"noise_filter": self._filter.state_dict()} if self._filter is not None else {}),
        }

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the run to `path` atomically (a dpltm 'run' checkpoint: `dpltm inspect` reads it); resume
        with `make_private(..., resume_from=path)`. An existing run file is replaced (saving each epoch to one
        path); any other existing file only with `overwrite=True`."""
        from dpltm.checkpoint import holds_checkpoint_of_kind, save_atomic
        from dpltm.outputs import check_checkpoint_name

        target = user_path(path, "path")
        check_checkpoint_name(target, "path")
        check_flag(overwrite, "overwrite")
        if not overwrite and (target.exists() or target.is_symlink()) and not holds_checkpoint_of_kind(target, "run"):
            raise DpltmUserError(f"{target} exists and is not a dpltm run file: not overwritten (save elsewhere, or "
                                 "pass overwrite=True)")
        save_atomic(self.state_dict(), target, "run")
        return target


_OWNERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[PrivateTraining]] = weakref.WeakKeyDictionary()
"""Each guarded optimiser's run, by weak reference: the run holds the optimiser, so a strong value would keep both
(and the run's copy of the records) alive for the life of the process (a sweep of make_private calls grew to 22 GB)."""


def _guard_optimizer(optimizer: torch.optim.Optimizer, run: PrivateTraining) -> None:
    """Make `optimizer.step()` refuse to run outside `run.step()`: a step on a gradient that was not
    clipped and noised (a user's own loop, a stray call) would update the model outside the ledger."""
    first = optimizer not in _OWNERS
    _OWNERS[optimizer] = weakref.ref(run)
    if first:
        def guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            ref = _OWNERS.get(opt)
            owner = ref() if ref is not None else None
            if owner is not None and not owner._in_step:
                raise DpltmUserError("this optimizer belongs to a dpltm private run: its steps must go through "
                                     "PrivateTraining.step() (a step on an unprivatised gradient is not DP)")

        optimizer.register_step_pre_hook(guard)
