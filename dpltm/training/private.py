"""Phase 3: DP-SGD on the masked winner (or the dense network, or non-private baselines).

A Lightning stage with manual optimisation: each step draws a Poisson batch of record indices
(q = L/N), computes masked per-sample norms and the clipped sum (dpltm.dp.ghost), lets the
noise plug-in perturb it on the surviving weights, divides by the expected batch size L and
steps the optimiser. After every epoch it logs validation/test accuracy and the ε spent so far
(from the same accountant that reports the final guarantee) through the run's Lightning logger.

The recipe options apply alike to tickets, the dense DP-SGD baseline and the non-private one:
SGD momentum (`--momentum`) acts on the privatized gradients, and the optional exponential
moving average of the iterates (`--ema`) is computed from the released iterates alone; both are
post-processing (docs/privacy.md §7) and change nothing in the accounting. With EMA on, the average is
what is evaluated every epoch and what the checkpoint releases. The noise filter (`--noise-filter`,
dpltm.dp.noise_filter) is post-processing of the released noisy gradients too; it applies to DP runs
only (the non-private baseline has no noise to filter and keeps the plain recipe).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.data.batches import ShuffledBatches
from dpltm.data.types import DatasetSplits, LabeledTensors
from dpltm.devices import require_cuda_for_graphs
from dpltm.dp.averaging import Ema, make_averager, released_model, released_weights, update_average
from dpltm.dp.distributed import Distribution, all_reduce_sum, rank_sampling_seed, shard
from dpltm.dp.engine import Loss, per_sample_cross_entropy, view_mean_cross_entropy
from dpltm.dp.ghost import MaskLayout
from dpltm.dp.graphed import StaticShapeDpStep
from dpltm.dp.mechanism import NoiseContext, NoiseMechanism
from dpltm.dp.noise import make_noise
from dpltm.dp.noise_filter import make_noise_filter
from dpltm.dp.padding import batch_capacity
from dpltm.dp.sampling import BatchGather, PoissonBatches
from dpltm.dp.step import DpSgdStep, record_terms, step_layout
from dpltm.errors import DpltmUserError, raise_if_stopping
from dpltm.masks import Masks, full_masks
from dpltm.privacy.accounting import EpsilonOutOfRange
from dpltm.privacy.display import format_epsilon
from dpltm.settings import TrainSettings
from dpltm.training.plain import MaskedModule, RoundProgressBar, accuracy, fit_on_device, lightning_trainer
from dpltm.training.plan import EpochRecord, TrainPlan

if TYPE_CHECKING:
    from dpltm.audit.canaries import GradientCanaries, InputCanaries

    AuditCanaries = GradientCanaries | InputCanaries


def mechanism_seed(noise_seed: int | None) -> tuple[int, str]:
    """The seed of the noise and Poisson-sampling generators, and how it was obtained.

    Anyone who knows this seed and holds all records but one can replay every batch and every
    noise draw, which voids the guarantee. So by default it comes from the OS CSPRNG and is
    never stored. A user-given seed (reproducible runs, tests) is not stored either, and the
    report says the guarantee then assumes it stays secret. (The generator itself is PyTorch's
    Philox/MT19937, not a CSPRNG, as in Opacus without `secure_mode`.)
    """
    if noise_seed is None:
        return secrets.randbits(63), "OS CSPRNG seed, not stored"
    return int(noise_seed), "user-given seed (reproducible; DP only while the seed stays secret; not stored)"


def epochs_within_budget(plan: TrainPlan, max_eps: float, epsilon_after: Callable[[int], float]) -> int:
    """The most epochs whose ε stays ≤ target (ε grows with steps; σ and q are fixed, so this is
    decided before training and depends on no data). A step count whose ε is beyond what the
    accountants are asked (`EpsilonOutOfRange`) is over any target."""

    def spent(epochs: int) -> float:
        try:
            return epsilon_after(epochs * plan.steps_per_epoch)
        except EpsilonOutOfRange:
            return math.inf

    if spent(1) > max_eps:
        raise DpltmUserError(f"--max-eps {max_eps:g} is spent within the first epoch "
                             f"(one epoch costs ε = {format_epsilon(spent(1))})")
    lo, hi = 1, plan.epochs  # ε(lo) ≤ target
    if spent(hi) <= max_eps:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if spent(mid) <= max_eps:
            lo = mid
        else:
            hi = mid
    return lo


def make_optimizer(settings: TrainSettings, parameters: Any, capturable: bool = False) -> torch.optim.Optimizer:
    """The optimiser of the recipe: SGD (with `settings.momentum`) or Adam, for DP and non-private
    runs alike. Under DP it only ever sees privatized gradients: post-processing. `capturable`:
    Adam keeps its step count on the device, so its step can be replayed from a CUDA graph."""
    if settings.optimizer == "adam":  # NoisyAdam (Bu et al. 2020): Adam on ĝ
        return torch.optim.Adam(parameters, lr=settings.lr, capturable=capturable)
    return torch.optim.SGD(parameters, lr=settings.lr, momentum=settings.momentum)


def per_record_loss(settings: TrainSettings) -> Loss:
    """Each record's loss: its cross-entropy, or with augmentation multiplicity (`settings.augmult` K > 1: the
    records' (B, K, …) views, dpltm.data.views) the mean of its K views' cross-entropies, whose gradient the DP
    step clips as the record's one contribution (De et al. 2022, §3)."""
    return per_sample_cross_entropy if settings.augmult == 1 else view_mean_cross_entropy


STEP_MODES = ("eager", "static", "graphs")
"""How a DP step runs (the mechanism is the same in all three): `eager`, one Lightning step per
Poisson batch with exact-size tensors (sparse kernels for sparse tickets: the CPU default);
`static`, the batch padded to a fixed capacity and run in fixed-shape pieces, a whole epoch per
Lightning step (dpltm.dp.graphed); `graphs`, the static pieces captured in CUDA graphs."""


def check_replicas_agree(model: nn.Module) -> None:
    """Raise if the ranks' weights differ. Every rank applies the same all-reduced ĝ, so they stay
    bit-identical; compared by a fingerprint (sums of the weights and of their squares, all-reduced
    as min and max)."""
    import torch.distributed as dist

    weights = [p.detach().double() for p in model.parameters()]
    total = torch.stack([sum(w.sum() for w in weights), sum((w * w).sum() for w in weights)])  # type: ignore[misc]
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError("DDP replicas diverged: the ranks did not apply the same noisy gradients")


class EpsilonCurve:
    """ε after each epoch, computed once, in a background thread, ahead of training.

    Each value is `epsilon_after(steps)` (the ledger's accountant) exactly; only the time it is
    computed moves off the training loop. A PLD computation takes ~0.3 s: on a GPU, 50 epochs of
    accounting would otherwise cost more than the training itself.
    """

    def __init__(self, epsilon_after: Callable[[int], float], steps: list[int]) -> None:
        self._epsilon_after = epsilon_after
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpltm-epsilon")
        self._futures: dict[int, Future[float]] = {}
        try:
            for n in steps:
                self._futures[n] = self._pool.submit(epsilon_after, n)
        except BaseException:  # a signal while queuing: the caller never holds this curve to cancel it, and
            self.cancel()      # the interpreter's exit would wait for every queued ε
            raise
        finally:
            self._pool.shutdown(wait=False)

    def __call__(self, steps: int) -> float:
        future = self._futures.get(steps)
        return future.result() if future is not None else self._epsilon_after(steps)

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()


class _OneEpochAtATime(torch.utils.data.IterableDataset[list[Tensor]]):
    """An epoch's Poisson batches as one item: static/graph steps loop over it inside one Lightning
    step, so Lightning's per-step work is paid once per epoch."""

    def __init__(self, batches: PoissonBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[list[Tensor]]:
        yield list(self.batches)


class RecipeModule(MaskedModule):
    """A network trained with the run's recipe, DP or not: the optimiser (`make_optimizer`), and the moving average
    of the iterates the settings ask for, whose weights are `released` (else the final iterate's)."""

    capturable = False
    """Adam keeps its step count on the device (a step replayed from a CUDA graph)."""

    def __init__(self, model: nn.Module, data: DatasetSplits, settings: TrainSettings, masks: Masks | None,
                 on_epoch: Callable[[EpochRecord], None] | None) -> None:
        super().__init__(model, masks)
        self.data, self.settings, self.on_epoch = data, settings, on_epoch
        self.ema = Ema.of(settings.ema, settings.ema_warmup)
        self.averager = make_averager(model, self.ema)
        self.history: list[EpochRecord] = []

    @property
    def released(self) -> nn.Module:
        return released_model(self.model, self.averager)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.settings, self.model.parameters(), capturable=self.capturable)


class DPTrainingModule(RecipeModule):
    """One DP-SGD step per Poisson batch; per-epoch evaluation, ε bookkeeping and stopping."""

    def __init__(self, model: nn.Module, data: DatasetSplits, plan: TrainPlan, settings: TrainSettings,
                 noise: NoiseMechanism, seed: int, epsilon_after: Callable[[int], float] | None,
                 on_epoch: Callable[[EpochRecord], None] | None = None,
                 distribution: Distribution | None = None, step_mode: str = "eager",
                 canaries: AuditCanaries | None = None, masks: Masks | None = None) -> None:
        """`masks`: the ticket beside `model` (installed: its pruned weights are zero); None: dense."""
        if canaries is not None and (step_mode != "eager" or (distribution or Distribution()).multi_process):
            raise DpltmUserError("an audit's canaries run in the eager step on one device")
        if step_mode not in STEP_MODES:
            raise DpltmUserError(f"step mode must be one of {', '.join(STEP_MODES)}, got {step_mode!r}")
        if step_mode == "graphs":
            require_cuda_for_graphs(data.train.labels.device)
        if step_mode == "graphs" and (distribution or Distribution()).multi_process:
            raise DpltmUserError("--cuda-graphs runs on one device; drop it with --devices/--num-nodes")
        super().__init__(model, data, settings, masks if masks is not None else full_masks(model), on_epoch)
        self.canaries = canaries
        self.step_mode = step_mode
        self.capturable = step_mode == "graphs"
        self.static_step: StaticShapeDpStep | None = None
        self.plan = plan
        self.noise = noise
        self.epsilon_after = epsilon_after
        self.seed = seed
        self.distribution = distribution or Distribution()
        self.noise_generator = torch.Generator(device=data.train.labels.device).manual_seed(seed)
        self.reduce: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None
        self.add_noise = True
        # masks (and any noise geometry) never change during training: nor does the first layer's
        # share of every record's masked norm (computed once, when training starts)
        if settings.augmult > 1 and step_mode != "eager":
            raise DpltmUserError("--augmult trains in the eager DP step (the static-shape and CUDA-graph steps take "
                                 "one view per record): drop --cuda-graphs or --augmult")
        self.layout = step_layout(model, self.masks, data.train.features.dtype, noise.coordinate_scales(),
                                  views=settings.augmult)
        if step_mode != "eager" and not isinstance(self.layout, MaskLayout):
            raise DpltmUserError("--cuda-graphs (and the static-shape step) run the networks of the fused DP step "
                                 "(--arch mlp, lenet5, scatter-linear, scatter-mlp, with every layer trained); this "
                                 "network trains in the eager step: drop --cuda-graphs")
        self.dp_step: DpSgdStep | None = None  # built when training starts, with the optimiser and the tables
        self.gather = BatchGather()
        self.stop_reason: str | None = None
        self._best_val = -1.0
        self._epochs_without_gain = 0

    def on_train_start(self) -> None:
        if self.canaries is not None:
            self.canaries.start(self.model, self.data.train.labels.device)
        optimizer = self.optimizers().optimizer  # type: ignore[union-attr]
        noise_filter = make_noise_filter(self.settings.noise_filter,
                                         {n: p for n, p in self.model.named_parameters() if p.requires_grad})
        if self.step_mode == "eager":
            self.dp_step = DpSgdStep(
                self.model, self.layout, self.settings.clip, self.noise, self.plan.expected_batch_size,
                self.noise_generator, optimizer, loss=per_record_loss(self.settings),
                terms=record_terms(self.model, self.layout, self.data.train.features),
                reduce=self.reduce, add_noise=self.add_noise, max_physical_batch_size=self.settings.physical_batch,
                averager=self.averager, ema=self.ema, noise_filter=noise_filter)
            return
        train = self.data.train
        shard_size = -(-len(train) // self.trainer.world_size)  # this rank samples from its shard only
        self.static_step = StaticShapeDpStep(
            self.model, self.masks, train, clip=self.settings.clip, noise=self.noise,
            expected_batch_size=self.plan.expected_batch_size,
            capacity=min(batch_capacity(shard_size, self.plan.sample_rate), self.settings.physical_batch or shard_size),
            generator=self.noise_generator, optimizer=optimizer,
            averager=self.averager, ema=self.ema, reduce=self.reduce,
            add_noise=self.add_noise, graphs=self.step_mode == "graphs", noise_filter=noise_filter)

    def setup(self, stage: str) -> None:
        """Under DDP: sum the ranks' clipped sums, rank 0 alone adding the noise (one draw:
        dpltm.dp.distributed); each rank samples with its own generator."""
        if self.trainer.world_size > 1:
            self.reduce = all_reduce_sum
            self.add_noise = self.trainer.global_rank == 0

    def train_dataloader(self) -> torch.utils.data.DataLoader[Tensor]:
        """This rank's Poisson batches: of its shard of the records under DDP, of all of them on one device."""
        rank, world = self.trainer.global_rank, self.trainer.world_size
        n, device = len(self.data.train), self.data.train.labels.device
        if self.canaries is not None:  # an audit's gradient canaries: slots N … N+m−1 of the sampled universe
            n += self.canaries.extra_records
        batches = PoissonBatches(n, self.plan.sample_rate, self.plan.steps_per_epoch,
                                 rank_sampling_seed(self.seed, rank), device, shard(n, rank, world, device),
                                 epoch_at_once=self.step_mode != "eager")
        dataset = batches if self.step_mode == "eager" else _OneEpochAtATime(batches)
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)

    def training_step(self, batch: Tensor | list[Tensor], batch_idx: int) -> None:
        if self.static_step is not None:  # a whole epoch of batches
            for index in batch:
                raise_if_stopping()
                self.static_step.step(index)
            return
        raise_if_stopping()
        assert isinstance(batch, Tensor) and self.dp_step is not None
        index, train, extra = batch, self.data.train, None
        if self.canaries is not None:  # an audit: excluded canaries' slots drop out; gradient canaries add theirs
            index, extra = self.canaries.split(index, len(train), dict(self.model.named_parameters()))
        x = self.gather(train.features, index)  # a view of a kept buffer (dpltm.dp.sampling.BatchGather)
        grads = self.dp_step.gradients(x, train.labels.index_select(0, index), index, extra_sums=extra)
        if self.canaries is not None:  # what the released iterates reveal at the canaries' coordinates
            self.canaries.record({k: v * self.plan.expected_batch_size for k, v in grads.items()})
        self.dp_step.apply(grads)

    def on_train_epoch_end(self) -> None:
        if self.trainer.world_size > 1:  # before anything about this epoch is reported
            check_replicas_agree(self.model)
        epoch = self.current_epoch + 1
        steps = epoch * self.plan.steps_per_epoch
        # Only what the released model or held-out data determine: no training loss, clipping
        # rate or timing of the private batches (they would be releases outside the accountant).
        record = {
            "epoch": epoch,
            "steps": steps,
            "val_accuracy": accuracy(self.released, self.data.val),
            "test_accuracy": accuracy(self.released, self.data.test),
            **({"epsilon": self.epsilon_after(steps)} if self.epsilon_after is not None else {}),
            **self.noise.epoch_metrics(self.model, self.masks, self.settings.clip),
        }
        self.history.append(record)
        self._maybe_stop(record)
        if self.on_epoch is not None:
            self.on_epoch(record)

    def _maybe_stop(self, record: EpochRecord) -> None:
        s = self.settings
        if s.patience is not None and not math.isnan(record["val_accuracy"]):
            if record["val_accuracy"] > self._best_val:
                self._best_val, self._epochs_without_gain = record["val_accuracy"], 0
            else:
                self._epochs_without_gain += 1
                if self._epochs_without_gain >= s.patience:
                    self.stop_reason = f"--patience {s.patience}: validation accuracy stopped improving"
                    self.trainer.should_stop = True


@dataclass
class TrainOutcome:
    history: list[EpochRecord]
    steps: int
    stop_reason: str
    released: nn.Module | None = None
    """The weights to release (the EMA, or the trained model itself); None: the trained model."""
    released_weights: str = "final iterate"


def run_private(model: nn.Module, data: DatasetSplits, plan: TrainPlan, settings: TrainSettings, *,
                seed: int, epsilon_after: Callable[[int], float] | None,
                progress: bool, noise_context: NoiseContext,
                on_epoch: Callable[[EpochRecord], None] | None = None,
                distribution: Distribution | None = None, step_mode: str = "eager",
                canaries: AuditCanaries | None = None, progress_label: str = "DP training") -> TrainOutcome:
    """DP-SGD under `plan`, on one device or, with `distribution`, over several processes (DDP);
    `step_mode` (see STEP_MODES) says how a step runs, not what it computes. With `progress`, a bar
    named `progress_label` on stderr. The ticket's masks are `noise_context.masks` (None: dense).
    `epsilon_after` gives the ε of each epoch's record, computed ahead in a background thread; None (the
    ranks other than 0 of a multi-device run, which report nothing) computes no ε and records none."""
    device = data.train.labels.device
    distribution = distribution or Distribution()
    noise = make_noise(settings.noise, plan.noise_parameter, noise_context)
    if abs(noise.effective_noise_multiplier - plan.noise_multiplier) > 1e-12 * max(1.0, plan.noise_multiplier):
        raise RuntimeError("noise plug-in disagrees with the plan's effective multiplier")
    # ε per epoch is reported by rank 0 alone: the other ranks of a multi-device run neither compute nor keep it
    curve = (EpsilonCurve(epsilon_after, [e * plan.steps_per_epoch for e in range(1, plan.epochs + 1)])
             if epsilon_after is not None else None)
    try:
        module = DPTrainingModule(model, data, plan, settings, noise, seed, curve, on_epoch, distribution,
                                  step_mode, canaries, masks=noise_context.masks)
        # No logger on the Trainer: `on_epoch` hands each epoch's record (released-model accuracies
        # and ε only) to the run's log (dpltm.run_log); nothing from private batches is logged.
        trainer = lightning_trainer(
            device,
            distribution=distribution,
            max_epochs=plan.epochs,
            logger=False,
            enable_progress_bar=progress,
            callbacks=[RoundProgressBar(progress_label)] if progress else [],
        )
        fit_on_device(trainer, module, None, device)
    finally:
        if curve is not None:
            curve.cancel()  # an interrupted or early-stopped run does not wait for the rest of the curve
    if trainer.world_size != distribution.world_size:
        raise RuntimeError(f"trained on {trainer.world_size} processes, expected {distribution.world_size}")
    steps = len(module.history) * plan.steps_per_epoch
    reason = module.stop_reason or f"finished {plan.epochs} epochs"
    return TrainOutcome(module.history, steps, reason, module.released, released_weights(module.ema))


class _EpochBatches(torch.utils.data.IterableDataset[tuple[Tensor, Tensor]]):
    """Every epoch's shuffled batches in one stream: epoch e reshuffles with seed·100003 + e."""

    def __init__(self, data: LabeledTensors, batch_size: int, steps_per_epoch: int, epochs: int,
                 seed: int) -> None:
        self.data, self.batch_size, self.steps_per_epoch = data, batch_size, steps_per_epoch
        self.epochs, self.seed = epochs, seed

    def __len__(self) -> int:
        return self.steps_per_epoch * self.epochs

    def __iter__(self) -> Any:
        for epoch in range(1, self.epochs + 1):
            yield from ShuffledBatches(self.data, self.batch_size, self.steps_per_epoch,
                                       self.seed * 100_003 + epoch)


class NonPrivateModule(RecipeModule):
    """The non-private baseline with the same recipe (optimiser, momentum, EMA) as the DP run:
    mean cross-entropy on shuffled batches, evaluated after every epoch."""

    def __init__(self, model: nn.Module, data: DatasetSplits, settings: TrainSettings,
                 steps_per_epoch: int, on_epoch: Callable[[EpochRecord], None] | None = None,
                 masks: Masks | None = None) -> None:
        super().__init__(model, data, settings, masks, on_epoch)
        self.steps_per_epoch = steps_per_epoch

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        raise_if_stopping()
        x, y = batch
        optimizer = self.optimizers().optimizer  # type: ignore[union-attr]
        optimizer.zero_grad(set_to_none=True)
        outputs = self.model(x)
        loss = F.cross_entropy(outputs, y) if self.settings.augmult == 1 else view_mean_cross_entropy(outputs, y).mean()
        loss.backward()
        optimizer.step()
        self.keep_pruned()  # type: ignore[misc]
        if self.averager is not None:
            update_average(self.averager, self.model, self.ema)  # type: ignore[arg-type]
        if (batch_idx + 1) % self.steps_per_epoch == 0:
            epoch = (batch_idx + 1) // self.steps_per_epoch
            self.history.append({"epoch": epoch, "steps": batch_idx + 1,
                                 "val_accuracy": accuracy(self.released, self.data.val),
                                 "test_accuracy": accuracy(self.released, self.data.test),
                                 "epsilon": math.inf})
            if self.on_epoch is not None:
                self.on_epoch(self.history[-1])


def run_non_private(model: nn.Module, data: DatasetSplits, settings: TrainSettings, *, seed: int,
                    progress: bool, on_epoch: Callable[[EpochRecord], None] | None = None,
                    masks: Masks | None = None) -> TrainOutcome:
    """The non-private baseline: the same network (and ticket: `masks`), epochs and recipe, without
    clipping or noise."""
    steps_per_epoch = math.ceil(len(data.train) / settings.batch_size)
    device = data.train.labels.device
    module = NonPrivateModule(model, data, settings, steps_per_epoch, on_epoch, masks)
    batches = torch.utils.data.DataLoader(
        _EpochBatches(data.train, settings.batch_size, steps_per_epoch, settings.epochs, seed),
        batch_size=None, num_workers=0,
    )
    trainer = lightning_trainer(
        device,
        max_epochs=1,  # one pass over the stream, which holds every epoch's batches
        logger=False,
        enable_progress_bar=progress,
        callbacks=[RoundProgressBar("non-private training")] if progress else [],
        deterministic=False,
    )
    fit_on_device(trainer, module, batches, device)
    if len(module.history) != settings.epochs:
        raise RuntimeError(f"non-private training ran {len(module.history)} epochs, expected {settings.epochs}")
    return TrainOutcome(module.history, settings.epochs * steps_per_epoch, f"finished {settings.epochs} epochs",
                        module.released, released_weights(module.ema))
