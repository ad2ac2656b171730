"""Masked DP-SGD for an existing LightningModule: a callback and a Poisson batch sampler.

    loader = dpltm.lightning.poisson_loader(train_dataset, batch_size=256)
    callback = dpltm.DPCallback(target_epsilon=1.0, delta=1e-5, max_grad_norm=1.0, masks=ticket_masks,
                                masks_from="public data")
    L.Trainer(max_epochs=10, callbacks=[callback]).fit(module, loader)
    callback.epsilon   # spent so far; also logged as "epsilon" every epoch

The module keeps its `training_step` (returning the batch loss, reduction "mean" over the batch
dimension or "sum": say which; each sample's loss must depend on its own record only) and its
optimiser (automatic optimisation, full precision, one device). During the backward pass the callback records,
for every nn.Linear / nn.Conv2d, the layer's input and the gradient reaching its output; before the
optimiser step it replaces the parameters' gradients with dpltm's masked clipped sum plus Gaussian
noise on the surviving weights, over the expected batch size (dpltm.dp.per_sample: the same code as
`make_private`). The loader must be Poisson (`poisson_loader`): the accountant assumes it.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from dpltm.api import apply_masks, check_user_masks, surviving_coordinates, user_run_ledger
from dpltm.config import TrainSettings
from dpltm.dp.noise import GaussianNoise
from dpltm.dp.per_sample import _Tap, clip_and_sum, trainable_layers
from dpltm.dp.sampling import poisson_sample
from dpltm.errors import DpltmUserError
from dpltm.privacy.ledger import PrivacyLedger
from dpltm.private_training import TrainPlan, plan_training
from dpltm.run_log import float32_at_least


class PoissonBatchSampler(Sampler[list[int]]):
    """`steps` Poisson batches per epoch: each of `n` records in each batch with probability q."""

    def __init__(self, n: int, batch_size: int, steps: int | None = None, seed: int | None = None) -> None:
        if not 0 < batch_size < n:
            raise DpltmUserError(f"batch_size must lie in (0, {n}), got {batch_size}")
        self.n, self.batch_size = n, batch_size
        self.sample_rate = batch_size / n
        self.steps = steps if steps is not None else math.ceil(n / batch_size)
        self.generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield poisson_sample(self.n, self.sample_rate, self.generator).tolist()


def poisson_loader(dataset: Dataset, batch_size: int, seed: int | None = None, **kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
    """A DataLoader of Poisson batches (expected size `batch_size`); an empty batch is a batch of zero
    rows (it still takes a noisy step), shaped like the dataset's first item."""
    n = len(dataset)  # type: ignore[arg-type]
    example = default_collate([dataset[0]])

    def collate(items: list[Any]) -> Any:
        if items:
            return default_collate(items)
        return [t[:0] for t in example] if isinstance(example, (list, tuple)) else example[:0]

    return DataLoader(dataset, batch_sampler=PoissonBatchSampler(n, batch_size, seed=seed), collate_fn=collate,
                      **kwargs)


class DPCallback(L.Callback):
    """Masked DP-SGD for a LightningModule with automatic optimisation (one optimiser, one device)."""

    def __init__(self, *, target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float = 1e-5, max_grad_norm: float = 1.0, masks: Mapping[str, Tensor] | None = None,
                 masks_from: str | None = None, loss_reduction: str = "mean", accountant: str = "pld",
                 noise_seed: int | None = None, masks_private: bool = False,
                 selection_eps1: float | None = None) -> None:
        if (target_epsilon is None) == (noise_multiplier is None):
            raise DpltmUserError("give target_epsilon (σ is calibrated) or noise_multiplier (ε is reported)")
        if loss_reduction not in ("mean", "sum"):
            raise DpltmUserError(f"loss_reduction must be mean or sum, got {loss_reduction!r}")
        if masks and not masks_from:
            raise DpltmUserError("say where the masks come from (masks_from=…): tickets made on the private "
                                 "records are not differentially private")
        self.target_epsilon, self.noise_multiplier, self.delta = target_epsilon, noise_multiplier, delta
        self.clip, self.masks_in, self.masks_from = max_grad_norm, dict(masks or {}), masks_from
        if not max_grad_norm > 0:
            raise DpltmUserError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.loss_reduction, self.accountant = loss_reduction, accountant
        self.masks_private, self.selection_eps1 = masks_private, selection_eps1
        self.seed = secrets.randbits(63) if noise_seed is None else int(noise_seed)
        self.generator: torch.Generator | None = None  # made once: a second fit continues its stream
        self._batch_size = 0
        self._calls: dict[int, int] = {}
        self.steps_done = 0
        self.history: list[dict[str, Any]] = []
        self.plan: TrainPlan | None = None
        self._taps: list[_Tap] = []
        self._grads: dict[int, Tensor] = {}
        self._handles: list[Any] = []

    # ---- set-up -------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:
            raise DpltmUserError("DPCallback runs on one device (multi-device DP: `dpltm train --devices`)")
        if not pl_module.automatic_optimization or trainer.accumulate_grad_batches != 1:
            raise DpltmUserError("DPCallback needs automatic optimisation without gradient accumulation")
        if str(trainer.precision) not in ("32-true", "64-true", "32", "64"):
            raise DpltmUserError(f"DPCallback needs full precision (got {trainer.precision}): mixed precision "
                                 "skips steps from the non-private gradients and rounds the clipping")
        sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
        if not isinstance(sampler, PoissonBatchSampler):
            raise DpltmUserError("DP-SGD's accountant assumes Poisson sampling: build the training loader with "
                                 "dpltm.lightning.poisson_loader(dataset, batch_size)")
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise DpltmUserError("set Trainer(max_epochs=…): σ is planned for the whole run")
        settings = TrainSettings(epochs=trainer.max_epochs, batch_size=sampler.batch_size, clip=self.clip,
                                 eps2=self.target_epsilon, sigma=self.noise_multiplier, delta=self.delta,
                                 accountant=self.accountant)
        self.plan = plan_training(settings, sampler.n)
        self.plan_steps_per_epoch = sampler.steps
        self.dataset_size = sampler.n
        self.masks = check_user_masks(pl_module, self.masks_in)
        apply_masks(pl_module, self.masks)
        self.noise = GaussianNoise(self.plan.noise_multiplier)
        self.surviving = surviving_coordinates(pl_module, self.masks)
        if self.generator is None:
            self.generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
            if getattr(self, "_generator_state", None) is not None:
                self.generator.set_state(self._generator_state)
        self._taps = [_Tap(name, module) for name, module in trainable_layers(pl_module)]
        for index, tap in enumerate(self._taps):
            self._handles.append(tap.module.register_forward_hook(self._forward_hook(index)))

    def _forward_hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if not module.training or not torch.is_grad_enabled():
                return
            tap = self._taps[index]
            self._calls[index] = self._calls.get(index, 0) + 1
            tap.input, tap.output = inputs[0].detach(), None
            if output.requires_grad:
                output.register_hook(lambda grad: self._grads.__setitem__(index, grad.detach()))
        return hook

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- the step -----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._batch_size = int(first.shape[0])  # the samples: every layer must see this many rows
        self._calls.clear()
        self._grads.clear()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        assert self.plan is not None
        if self.steps_done >= self.plan.steps:
            raise DpltmUserError(f"the planned {self.plan.steps} steps are done: the privacy budget is spent")
        if len(self._grads) != len(self._taps):
            missing = [t.name for i, t in enumerate(self._taps) if i not in self._grads]
            raise DpltmUserError(f"no gradient reached layer(s) {missing}: every trainable layer must take part")
        twice = [self._taps[i].name for i, n in self._calls.items() if n > 1]
        if twice:
            raise DpltmUserError(f"layer(s) {twice} ran twice in one step: weight sharing is not supported by "
                                 "dpltm's per-sample clipping")
        batch = self._batch_size
        scale = float(batch) if self.loss_reduction == "mean" else 1.0  # back to per-sample gradients
        grads = [self._grads[i] * scale for i in range(len(self._taps))]
        parameters = dict(pl_module.named_parameters())
        if batch == 0:
            sums = {n: torch.zeros_like(p) for n, p in parameters.items() if p.requires_grad}
        else:
            sums, _ = clip_and_sum(self._taps, grads, self.masks, self.clip, batch_size=batch)
        assert self.generator is not None
        noisy = self.noise.perturb(sums, self.surviving, self.clip, self.generator)
        for name, parameter in parameters.items():
            if parameter.requires_grad:
                parameter.grad = noisy[name].mul_(1.0 / self.plan.expected_batch_size)
        self._grads.clear()
        self.steps_done += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        apply_masks(pl_module, self.masks)  # pruned weights stay exactly zero whatever the optimiser does

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"epoch": trainer.current_epoch + 1, "steps": self.steps_done, "epsilon": self.epsilon}
        self.history.append(record)
        # Lightning keeps logged values as float32 tensors: log the smallest float32 ≥ ε, never less
        pl_module.log("epsilon", float32_at_least(record["epsilon"]), prog_bar=True)

    # ---- resuming: what was spent travels in Lightning's checkpoint ---------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "history": self.history, "seed": self.seed,
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done, self.history, self.seed = state["steps_done"], state["history"], state["seed"]
        self._generator_state = state.get("generator")  # restored on the module's device at train start

    # ---- what was spent -----------------------------------------------------------------------
    def ledger(self) -> PrivacyLedger:
        assert self.plan is not None, "fit first"
        return user_run_ledger(self.plan, self.steps_done, self.clip, self.dataset_size, self.delta, self.accountant,
                               self.masks, self.masks_from, self.masks_private, self.selection_eps1,
                               "the training loader's dataset")

    @property
    def epsilon(self) -> float:
        """The run's ε so far; ∞ when the masks came from the private records (`masks_private`)."""
        return 0.0 if self.steps_done == 0 else self.ledger().overall_epsilon
