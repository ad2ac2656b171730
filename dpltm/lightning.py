"""Masked DP-SGD for an existing LightningModule: a callback and a Poisson batch sampler.

    loader = dpltm.lightning.poisson_loader(train_dataset, batch_size=256)
    callback = dpltm.DPCallback(target_epsilon=1.0, delta=1e-5, max_grad_norm=1.0, masks=ticket_masks,
                                masks_from="public data")
    L.Trainer(max_epochs=10, callbacks=[callback]).fit(module, loader)
    callback.epsilon   # spent so far; also logged as "epsilon" every epoch

The module keeps its `training_step` (returning the batch loss, reduction "mean" over the batch
dimension or "sum": say which; each sample's loss must depend on its own record only) and its
optimiser (automatic optimisation, full precision, one device). During the backward pass the callback records,
for every layer owning trainable parameters (dpltm.dp.rules: exact rules for Linear, Conv1d/2d, the norms
and Embedding, torch.func for the rest), the layer's inputs and the gradient reaching its output; before the
optimiser step it replaces the parameters' gradients with dpltm's masked clipped sum plus Gaussian
noise on the surviving weights, over the expected batch size (dpltm.dp.engine: the same code as
`make_private`). The loader must be Poisson (`poisson_loader`): the accountant assumes it.

The sampler and loader live in dpltm.poisson_batches, the checks of the user's module in
dpltm.module_checks; both are importable from here, where users import them.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import lightning as L
import torch
from torch import Tensor

from dpltm.api_checks import (
    PrivacyOptions,
    Provenance,
    check_budget_left,
    check_clip,
    check_model_and_optimizer,
    warn_if_delta_above_one_over_n,
)
from dpltm.dp.engine import clip_and_sum_in_chunks, trainable_layers
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.independence import probe_rows
from dpltm.dp.noise_filter import NoiseFilter
from dpltm.dp.rules import LayerCall
from dpltm.dp.step import DpSgdStep, EngineLayout, check_steps_left
from dpltm.errors import DpltmUserError
from dpltm.module_checks import first_written, probe_first_batch, state_marks, trainable_names, written_message
from dpltm.poisson_batches import PoissonBatchSampler, batch_rows, poisson_loader
from dpltm.privacy.display import for_progress_bar
from dpltm.privacy.ledger import PrivacyLedger, before_any_step
from dpltm.privacy.segments import SpentSegments
from dpltm.private_training import LedgerReadout, restored_noise_filter
from dpltm.run_log import float32_at_least
from dpltm.settings import check_noise_filter
from dpltm.training.plan import EpochRecord, TrainPlan, plan_training
from dpltm.user_inputs import apply_masks, check_user_masks, user_run_ledger
from dpltm.weight_guard import check_not_trained_elsewhere, note_fit_end, note_private_step

__all__ = ["DPCallback", "PoissonBatchSampler", "poisson_loader", "probe_first_batch", "trainable_names"]

STATE_VERSION = 2
"""The callback's checkpoint state: 2 = spent segments, no seed or generator (1 held both)."""


class DPCallback(L.Callback, LedgerReadout):
    """Masked DP-SGD for a LightningModule with automatic optimisation (one optimiser, one device).

    What was spent is recorded segment by segment, as it ran: a second `fit`, or a resume from a
    Lightning checkpoint, opens a new segment at the (q, σ) it runs at, and the ledger composes every
    segment (docs/privacy.md §8). With `target_epsilon`, each fit calibrates σ for what is left of the
    budget given the segments already spent, or refuses when nothing is left. No seed or generator
    state is ever written to a checkpoint: a resumed fit draws fresh OS randomness.

    `max_physical_batch_size` bounds the rows whose per-sample norms and clipped sums are formed at once from
    the recorded layers (the module's own forward and backward see the whole Poisson batch): the chunks'
    clipped sums are added before the one noise draw, the same mechanism and ε.

    Checked at every step: the batch has the size of the sampler's next batch, the optimiser steps once
    per batch and only on the privatised gradient, and no other private run stepped these weights since.
    Checked at each fit's start: the optimiser updates exactly the module's trainable parameters, the
    sampler draws from the whole dataset at the planned steps, and the first batch's rows (up to 64) pass
    the independence probe in the modes the fit runs in. Not checkable: a `training_step` whose loss mixes
    the batch's records (a penalty on the batch's mean output: `make_private` probes its `loss`, the callback
    cannot call `training_step` on rows of its own), a module hook that replaces records within a batch of the
    right size, or two fits resumed from one checkpoint whose models are both released (each ledger counts
    its own branch only)."""

    def __init__(self, *, target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float | None = None, max_grad_norm: float = 1.0, masks: Mapping[str, Tensor] | None = None,
                 masks_from: str | None = None, loss_reduction: str = "mean", accountant: str = "pld",
                 noise_seed: int | None = None, masks_private: bool = False,
                 selection_eps1: float | None = None, neighboring: str = "add_remove",
                 target_delta: float | None = None, max_physical_batch_size: int | None = None,
                 noise_filter: str = "none") -> None:
        """`noise_filter`: a low-pass filter over the noisy gradients before the optimiser (`doppler`,
        dpltm.dp.noise_filter; post-processing, no ε); its history travels in the callback's checkpoint state."""
        self.noise_filter = check_noise_filter(noise_filter, "noise_filter")
        self._filter: NoiseFilter | None = None  # the fit's, built when it starts
        self._filter_state: Mapping[str, Any] | None = None  # a checkpoint's, loaded into the next fit's filter
        if loss_reduction not in ("mean", "sum"):
            raise DpltmUserError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if masks_from is not None and not isinstance(masks_from, str):
            raise DpltmUserError("DPCallback's masks_from is a string (where the masks came from); to have the "
                                 "overlap with public data checked, use make_private")
        self.options = PrivacyOptions.checked(
            target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, delta=delta, target_delta=target_delta,
            accountant=accountant, neighboring=neighboring, masks=masks, masks_from=masks_from,
            masks_private=masks_private, selection_eps1=selection_eps1, noise_seed=noise_seed,
            max_physical_batch_size=max_physical_batch_size, where_from="masks_from=…")
        self.clip = check_clip(max_grad_norm)
        self.masks_in, self.masks_from = dict(self.options.masks), masks_from
        self.loss_reduction = loss_reduction
        self._noise_seed = self.options.noise_seed  # used once, by the first fit of a fresh callback; never stored
        self._noise_generator: torch.Generator | None = None
        self._dp: DpSgdStep | None = None  # the fit's step from the clipped sums on, built when it starts
        self._fresh_noise = False
        self._probed_modes: set[tuple[bool, ...]] = set()  # the module modes the probe has seen this fit
        self.segments = SpentSegments()
        self.history: list[EpochRecord] = []
        self.plan: TrainPlan | None = None
        self.masks: dict[str, Tensor] = {}
        self.dataset_size = 0
        self._sampler: PoissonBatchSampler | None = None
        self._seeds_used: set[int] = set()
        self._pending_seed: int | None = None
        self._stored_provenance: CallbackProvenance | None = None
        self._batch_size = 0
        self._stepped = False
        self._privatised = False
        self._calls: dict[int, int] = {}
        self._taps: list[LayerCall] = []
        self._clipping = False
        self._in_batch = False  # between a training batch's start and its optimiser step: the forwards to record
        self._batch: Any = None  # the step's batch, for a probe in the modes its forward ran in
        self._step_modes: set[tuple[bool, ...]] = set()  # the modes of the forwards whose outputs took a gradient
        self._modules: list[torch.nn.Module] = []  # the fit's modules, in module_modes' order
        self._trainable: frozenset[str] = frozenset()
        self._grads: dict[int, Tensor] = {}
        self._handles: list[Any] = []
        self._optimizer: torch.optim.Optimizer | None = None  # the fit's optimiser, the one whose steps are checked
        self._module: L.LightningModule | None = None
        self._marks: dict[str, tuple[int, float]] = {}  # parameters' and buffers' versions and norms at batch start,
        # until the step's one check of them (`_check_no_writes`)
        self._written: dict[str, tuple[torch.nn.Parameter, Tensor, int]] = {}  # each noisy gradient as written

    # ---- set-up -------------------------------------------------------------------------------
    def _poisson_sampler(self, trainer: L.Trainer) -> PoissonBatchSampler:
        sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
        if not isinstance(sampler, PoissonBatchSampler):
            raise DpltmUserError("DP-SGD's accountant assumes Poisson sampling: build the training loader with "
                                 "dpltm.lightning.poisson_loader(dataset, batch_size)")
        return sampler

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before any other callback's on_fit_start: Lightning's tuners run optimiser steps on the raw gradients of
        the private batches there (LearningRateFinder) and keep what they chose (BatchSizeFinder)."""
        from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

        tuners = [type(c).__name__ for c in trainer.callbacks if isinstance(c, (LearningRateFinder, BatchSizeFinder))]
        if stage == "fit" and tuners:
            raise DpltmUserError(f"{tuners[0]} trains on the raw gradients of the private batches and keeps its "
                                 "choice: not differentially private; tune on public data, then fit with DPCallback")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:
            raise DpltmUserError("DPCallback runs on one device (multi-device DP: `dpltm train --devices`)")
        self._probed_modes = set()  # each fit probes its first batch (dpltm.dp.independence)
        if self._stored_provenance is None:  # not restored from a checkpoint of this run
            check_not_trained_elsewhere(pl_module, self)
        _check_optimisation(trainer, pl_module)
        sampler = self._poisson_sampler(trainer)
        if sampler.seed is not None:
            # a seeded sampler replays its batches: a resumed or repeated fit would redraw the same ones
            if self._fresh_noise or sampler.seed in self._seeds_used:
                raise DpltmUserError("this fit's poisson_loader(seed=…) would replay the batches of an earlier fit or "
                                     "of the run it resumes: drop seed (fresh OS randomness) or use a new one")
        self._pending_seed = sampler.seed  # used once this fit takes a step (a fit refused before one did not use it)
        self._check_provenance()
        self.plan = self._fit_plan(trainer, sampler)
        self.segments.begin(self.plan.sample_rate, self.plan.noise_multiplier, self.clip,
                            self.plan.expected_batch_size, sampler.n)
        self._sampler = sampler
        self.dataset_size = sampler.n
        warn_if_delta_above_one_over_n(self.options.delta, sampler.n, stacklevel=2)
        self.masks = check_user_masks(pl_module, self.masks_in)
        apply_masks(pl_module, self.masks)
        if self._noise_generator is None or self._fresh_noise:
            first_use = self._noise_seed is not None and not self._fresh_noise
            seed = self._noise_seed if first_use else secrets.randbits(63)
            self._noise_generator = torch.Generator(device=pl_module.device).manual_seed(seed)
            self._noise_seed, self._fresh_noise = None, False
        # the step from the clipped sums on (the sums come from Lightning's own backward)
        if self._filter is None:  # a second fit continues the first's filter
            self._filter = restored_noise_filter(self.noise_filter, pl_module, self._filter_state,
                                                 "this checkpoint's noise filter does not fit the module")
        self._dp = DpSgdStep(pl_module, EngineLayout.of(pl_module, self.masks),
                             self.clip, GaussianNoise(self.plan.noise_multiplier), self.plan.expected_batch_size,
                             self._noise_generator, max_physical_batch_size=self.options.max_physical_batch_size,
                             noise_filter=self._filter)
        self._taps = [LayerCall(name, module) for name, module in trainable_layers(pl_module)]
        self._modules = list(pl_module.modules())
        self._trainable = trainable_names(pl_module)
        for index, tap in enumerate(self._taps):
            self._handles.append(tap.module.register_forward_hook(self._forward_hook(index, pl_module),
                                                                  with_kwargs=True))
        self._optimizer, self._module = trainer.optimizers[0], pl_module
        self._handles.append(trainer.optimizers[0].register_step_pre_hook(self._checked_closure))
        self._handles.append(trainer.optimizers[0].register_step_post_hook(self._after_optimizer_step))

    def _fit_plan(self, trainer: L.Trainer, sampler: PoissonBatchSampler) -> TrainPlan:
        """The fit's (q, σ, steps): with target_epsilon, σ for what is left of the budget given every segment
        spent (or a refusal)."""
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise DpltmUserError("set Trainer(max_epochs=…): σ is planned for the whole fit")
        o = self.options
        settings = o.train_settings(epochs=max(1, trainer.max_epochs - trainer.current_epoch),
                                    batch_size=sampler.batch_size, clip=self.clip)
        spent = self.segments.events()
        check_budget_left(spent, o.target_epsilon, o.delta, o.accountant, o.neighboring, o.selection_eps1)
        dataset = getattr(trainer.train_dataloader, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) != sampler.n:
            raise DpltmUserError(f"the Poisson sampler draws from {sampler.n} records but the training dataset holds "
                                 f"{len(dataset)}: build the loader with poisson_loader(dataset, batch_size)")
        plan = plan_training(settings, sampler.n, spent=spent or None, selection_eps1=o.selection_eps1)
        if sampler.steps > plan.steps_per_epoch:  # fewer only spend less than planned
            raise DpltmUserError(f"the Poisson sampler draws {sampler.steps} batches an epoch, but the fit is planned "
                                 f"for {plan.steps_per_epoch} (N/L) and would stop when they are done: build the "
                                 "loader with poisson_loader(dataset, batch_size)")
        return plan

    def _changed_gradient(self) -> str | None:
        """The first parameter whose gradient is not the noisy one `on_before_optimizer_step` wrote, as written."""
        return next((name for name, (parameter, grad, version) in self._written.items()
                     if parameter.grad is not grad or grad._version != version), None)

    @staticmethod
    def _changed_message(name: str, outcome: str) -> str:
        return (f"the gradient of {name} was replaced or changed after DPCallback noised it (in the module's "
                f"on_before_optimizer_step, a callback after DPCallback, or configure_gradient_clipping): {outcome}")

    def _not_private(self, message: str) -> NoReturn:
        """An update outside the mechanism ran: counted (every ε after it is ∞), the weights noted as this run's
        (another run on them is refused), and the fit stopped."""
        self._raw_steps += 1
        self._privatised, self._written, self._marks = False, {}, {}
        if self._module is not None:
            note_private_step(self._module, self)
        raise DpltmUserError(message)

    def _check_no_writes(self, when: str) -> None:
        """Once a step, before its update: no parameter or buffer was written since the batch began (the marks are
        then dropped, so the update itself is never mistaken for a write)."""
        if not self._marks or self._module is None:
            return
        moved = first_written(self._marks, state_marks(self._module))
        self._marks = {}
        if moved is not None:
            self._not_private(written_message(moved, when))

    def _checked_closure(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The step's closure (training_step, backward, every on_before_optimizer_step hook, Lightning's gradient
        clipping), then the checks that nothing was written since the batch began and that the gradients are
        still the noisy ones DPCallback wrote: a hook that runs after DPCallback's may write the weights, or
        replace or add to the gradients, and the optimiser would update next. Refused there, before the update.
        A step whose closure ran before `optimizer.step()` (no closure given) is checked here at once."""
        closure = kwargs.get("closure")
        if closure is None:
            self._check_no_writes("before the optimiser's step")
            return None  # `_after_optimizer_step` checks the gradients after the update

        def checked() -> Any:
            try:
                result = closure()
            except BaseException:  # a step refused inside (a closure run twice, as SAM does) may follow a write
                self._check_no_writes("before DPCallback's noisy step")
                raise
            self._check_no_writes("before the optimiser's update")
            changed = self._changed_gradient() if self._privatised else None
            if changed is not None:
                self._privatised, self._written = False, {}
                raise DpltmUserError(self._changed_message(changed, "refused before the optimiser's update"))
            self._written = {}  # checked: what the optimiser then does to the gradients is its own
            return result

        return args, {**kwargs, "closure": checked}

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimiser step must have been privatised by `on_before_optimizer_step` (an override of
        `optimizer_step` that calls the raw optimiser skips it), on the very gradients it wrote (checked here when
        no closure could be checked before the update). Otherwise the model is no longer DP: counted, so every
        ε after it is ∞."""
        privatised, self._privatised = self._privatised, False
        changed = self._changed_gradient() if privatised else None
        self._written = {}
        if not privatised:
            self._not_private("the optimiser stepped on a gradient DPCallback did not clip and noise (an "
                              "optimizer_step override?): the model is no longer differentially private")
        if changed is not None:
            self._not_private(self._changed_message(changed, "the optimiser stepped on it, and the model is no "
                                                             "longer differentially private"))
        if self._module is not None:  # these weights carry this run's steps now, even if a later hook raises
            note_private_step(self._module, self)

    def _provenance(self) -> CallbackProvenance:
        return CallbackProvenance(bool(self.options.masks_private and (self.masks_in or self.masks)),
                                  self.options.selection_eps1, self.options.neighboring, sorted(self.masks_in))

    def _check_provenance(self) -> None:
        """A resume must keep what made the stored ε: masks from private records, ε1, the relation."""
        if self._stored_provenance is None:
            return
        differ = self._stored_provenance.differences(self._provenance())
        if differ:
            raise DpltmUserError(f"the checkpoint's run was made with {differ}: resume with the same DPCallback "
                                 "settings")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Loaders may be reloaded between epochs: each epoch must draw from a Poisson sampler at the
        planned N and L (the q the accountant was told)."""
        sampler = self._poisson_sampler(trainer)
        if (sampler.n, sampler.batch_size) != (self.dataset_size, self.plan.expected_batch_size if self.plan else 0):
            raise DpltmUserError(f"the reloaded training loader samples {sampler.batch_size} of {sampler.n} records; "
                                 f"this fit was planned for {self.plan.expected_batch_size if self.plan else '?'} of "
                                 f"{self.dataset_size}: start a new fit to change the sampling rate")
        self._sampler = sampler

    def _forward_hook(self, index: int, pl_module: L.LightningModule) -> Any:
        """Each forward of the layer in a training step is recorded on its own; the one whose output takes a
        gradient in the backward is the step's (`_took_gradient`). A forward whose output takes none (an eval pass
        for logging, detached) trained nothing and is dropped; two that take one are weight sharing."""
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._in_batch or not torch.is_grad_enabled() or self._clipping:
                # not a training step's forward (validation, a probe; a layer in eval mode still trains), or the
                # engine's own per-sample calls (torch.func rule)
                return
            call = LayerCall(self._taps[index].name, module)
            call.record(module, inputs, kwargs, output, keep_output=False)  # the backward hook gives g
            modes = self._modes()  # what the probe must have seen for this forward
            if output.requires_grad:
                output.register_hook(lambda grad: self._took_gradient(index, call, modes, grad))
        return hook

    def _took_gradient(self, index: int, call: LayerCall, modes: tuple[bool, ...], grad: Tensor) -> None:
        self._calls[index] = self._calls.get(index, 0) + 1
        self._grads[index] = grad.detach()
        tap = self._taps[index]
        tap.inputs, tap.kwargs = call.inputs, call.kwargs
        self._step_modes.add(modes)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._in_batch, self._batch, self._privatised, self._written, self._marks = False, None, False, {}, {}
        note_fit_end(pl_module, self)  # Lightning moves a GPU module to the CPU next: the guard must still know it
        self.segments.end()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # the steps taken stay counted; hooks are removed

    # ---- the step -----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_size = batch_rows(batch)  # the samples: every layer must see this many rows
        check_not_trained_elsewhere(pl_module, self)  # two runs on the same weights cannot interleave
        # the first batch, and again whenever the modules are in modes not probed yet (a layer may mix records
        # only in training mode); the modes the step's forward ran in are checked again before its noise
        self._probe_modes(pl_module, batch, self._modes())
        issued = self._sampler.next_issued() if self._sampler is not None else None
        if issued is None or issued != self._batch_size:
            raise DpltmUserError(f"a training batch of {self._batch_size} rows did not come from the run's Poisson "
                                 "sampler (poisson_loader): the accountant covers only its batches")
        self._stepped = False
        self._calls.clear()
        self._grads.clear()
        self._step_modes.clear()
        self._batch = batch
        self._marks = state_marks(pl_module)  # after the probe, which puts buffers back
        self._in_batch = True

    def _probe_modes(self, pl_module: L.LightningModule, batch: Any, modes: tuple[bool, ...]) -> None:
        """The independence probe on `batch` with the modules in `modes`, unless probed in them this fit (an empty
        batch has no rows to probe: the next one); the modules are left in the modes they were in."""
        if modes in self._probed_modes or self._batch_size == 0:
            return
        now = self._modes()
        try:
            for module, mode in zip(self._modules, modes):
                module.training = mode
            probe_first_batch(pl_module, batch, rows=probe_rows(self.plan.expected_batch_size if self.plan else 0))
        finally:
            for module, mode in zip(self._modules, now):
                module.training = mode
        self._probed_modes.add(modes)

    def _modes(self) -> tuple[bool, ...]:
        """Each module's training flag (dpltm.dp.independence.module_modes), read from the fit's list of modules:
        asked at every layer's forward, where walking the module tree would cost 0.6 ms a step on a ResNet-18."""
        return tuple(module.training for module in self._modules)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        assert self.plan is not None
        self._in_batch = False
        if optimizer is not self._optimizer:  # its steps would escape the check of `_after_optimizer_step`
            raise DpltmUserError("the optimiser changed during the fit (trainer.strategy.optimizers replaced): the "
                                 "fit's optimiser is checked at its start; start a new fit to change it")
        if self._stepped:
            raise DpltmUserError("the optimiser evaluated the loss twice on one batch (a closure run more than once): "
                                 "one Poisson step allows one noisy gradient")
        check_steps_left(self.segments.open_steps, self.plan.steps)
        if trainable_names(pl_module) != self._trainable:
            raise DpltmUserError("the module's trainable parameters changed during the fit (a layer frozen or "
                                 "unfrozen): the fit's layers were set at its start; start a new fit to change them")
        if not self._grads and self._taps:
            raise DpltmUserError("no gradient reached any layer: training_step must return the batch loss")
        if len(self._grads) != len(self._taps):
            missing = [t.name for i, t in enumerate(self._taps) if i not in self._grads]
            raise DpltmUserError(f"no gradient reached layer(s) {missing}: every trainable layer must take part")
        twice = [self._taps[i].name for i, n in self._calls.items() if n > 1]
        if twice:
            raise DpltmUserError(f"layer(s) {twice} ran twice in one step: weight sharing is not supported by "
                                 "dpltm's per-sample clipping")
        for modes in self._step_modes:  # modes set after the batch began (in training_step, a module hook)
            self._probe_modes(pl_module, self._batch, modes)
        batch = self._batch_size
        scale = float(batch) if self.loss_reduction == "mean" else 1.0  # back to per-sample gradients
        grads = [self._grads[i] * scale for i in range(len(self._taps))]
        parameters = dict(pl_module.named_parameters())
        if batch == 0:
            sums = {n: torch.zeros_like(p) for n, p in parameters.items() if p.requires_grad}
        else:
            for tap in self._taps:  # the backward's batch gradients, for the rules that check per-sample-ness
                tap.batch_grads = {n: p.grad * scale for n, p in tap.trainable().items() if p.grad is not None}
            self._clipping = True
            try:
                sums = clip_and_sum_in_chunks(self._taps, grads, self.masks, self.clip, batch,
                                              self.options.max_physical_batch_size)
            finally:
                self._clipping = False
        assert self._dp is not None
        grads = self._dp.apply(self._dp.noisy_gradients(sums))  # installed: Lightning steps the optimiser
        for name, parameter in parameters.items():
            if parameter.requires_grad:
                self._written[name] = (parameter, grads[name], grads[name]._version)
        self._grads.clear()
        self._stepped = True
        self._privatised = True
        self.segments.count_step()
        if self._pending_seed is not None:
            self._seeds_used.add(self._pending_seed)
            self._pending_seed = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._in_batch, self._batch = False, None
        self._check_no_writes("in a batch that took no optimiser step")  # the marks are gone after a step's check
        apply_masks(pl_module, self.masks)  # pruned weights stay exactly zero whatever the optimiser does
        if self._stepped:
            note_private_step(pl_module, self)  # again: apply_masks moved the version counters

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"epoch": trainer.current_epoch + 1, "steps": self.steps_done, "epsilon": self.epsilon}
        self.history.append(record)
        # Lightning keeps logged values as float32 tensors: log the smallest float32 ≥ ε, never less; its
        # progress bars round what they print to nearest, so the bar gets ε rounded up to what they print
        pl_module.log("epsilon", float32_at_least(record["epsilon"]), logger=True)
        pl_module.log("ε", float32_at_least(for_progress_bar(record["epsilon"])), prog_bar=True, logger=False)

    # ---- resuming: what was spent travels in Lightning's checkpoint, never a seed ---------------
    def state_dict(self) -> dict[str, Any]:
        return {"format_version": STATE_VERSION, "segments": self.segments.state(), "history": list(self.history),
                "provenance": asdict(self._provenance()), "tainted": self._raw_steps > 0,
                "non_private_updates": self._raw_steps,
                # the mechanism a tainted run with no DP step ran at: its ledger still says NOT DP after a reload
                "latest_mechanism": self.segments.latest_mechanism if self._raw_steps else None,
                **({"noise_filter": self._filter.state_dict()} if self._filter is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format_version") != STATE_VERSION or "segments" not in state:
            raise DpltmUserError("this checkpoint's DPCallback state was written by an older dpltm that did not record "
                                 "its (q, σ, steps) segments: what it spent cannot be accounted; start a new run")
        self.segments = SpentSegments(state["segments"])
        latest = state.get("latest_mechanism")
        if isinstance(latest, dict) and not self.segments.records():
            self.segments.note_mechanism(latest)
        self.history = list(state.get("history", []))
        self._stored_provenance = CallbackProvenance.stored(state.get("provenance"))
        stored = state.get("non_private_updates", 0)
        stored = stored if isinstance(stored, int) and not isinstance(stored, bool) and stored >= 0 else 0
        # a checkpoint written before the count was kept says only "tainted": at least one
        self._raw_steps = max(self._raw_steps, stored, int(bool(state.get("tainted", False))))
        self._fresh_noise = True  # never continue (or replay) a stored stream: fresh OS randomness
        stored_filter = state.get("noise_filter")
        if (stored_filter is None) != (self.noise_filter == "none") or (
                isinstance(stored_filter, dict) and stored_filter.get("name") != self.noise_filter):
            saved = "none" if not isinstance(stored_filter, dict) else stored_filter.get("name")
            raise DpltmUserError(f"this checkpoint's run filtered its noisy gradients with noise_filter={saved!r}: "
                                 f"resume with the same (given {self.noise_filter!r})")
        self._filter, self._filter_state = None, stored_filter

    # ---- what was spent -----------------------------------------------------------------------
    def ledger(self) -> PrivacyLedger | None:
        """Every segment spent so far, composed; None before the first step."""
        o = self.options
        return user_run_ledger(self.segments, o.delta, o.accountant, o.neighboring, self.masks or self.masks_in,
                               self.masks_from, o.masks_private, o.selection_eps1, "the training loader's dataset",
                               non_private_updates=self._raw_steps)

    def before_any_step(self) -> tuple[float, str]:
        return before_any_step(bool(self.masks_from and (self.masks or self.masks_in)), self.options.masks_private,
                               self.options.selection_eps1)


@dataclass(frozen=True)
class CallbackProvenance(Provenance):
    """A `DPCallback` run's provenance, and the weights its masks cover."""

    masked_weights: list[str]

    @classmethod
    def stored(cls, state: object) -> CallbackProvenance | None:
        """As the callback's checkpoint state holds it, the values as read (None: none stored)."""
        if state is None:
            return None
        get = state.get if isinstance(state, Mapping) else {}.get
        return cls(get("masks_private"), get("selection_eps1"), get("neighboring"), get("masked_weights"))


def _check_optimisation(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """What DPCallback's step assumes of the fit: automatic optimisation, one optimiser over exactly the module's
    trainable parameters, no gradient clipping of its own, full precision."""
    if not pl_module.automatic_optimization or trainer.accumulate_grad_batches != 1:
        raise DpltmUserError("DPCallback needs automatic optimisation without gradient accumulation")
    if len(trainer.optimizers) != 1:
        raise DpltmUserError(f"DPCallback needs exactly one optimiser, the module has {len(trainer.optimizers)}")
    # the optimiser must update exactly the module's trainable parameters: one it holds from elsewhere would
    # step on its raw gradient, which no rule clips or noises
    check_model_and_optimizer(pl_module, trainer.optimizers[0])
    if trainer.gradient_clip_val:  # it would clip the noisy mean in place, which the step check reads as a write
        raise DpltmUserError("Trainer(gradient_clip_val=…) clips the batch's noisy mean gradient, not each "
                             "sample's: DPCallback's max_grad_norm is the per-sample clipping; drop "
                             "gradient_clip_val")
    if str(trainer.precision) not in ("32-true", "64-true", "32", "64"):
        raise DpltmUserError(f"DPCallback needs full precision (got {trainer.precision}): mixed precision "
                             "skips steps from the non-private gradients and rounds the clipping")
