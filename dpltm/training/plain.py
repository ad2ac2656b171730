"""Non-private training of a network and its ticket: a LightningModule run by a Lightning Trainer.

Used by ticket generation (phase 1) and the non-private baseline. The loop is the plain one
(cross-entropy, SGD); per-step work is kept to the forward/backward pass and one in-place
accumulation of the loss, with no host synchronisation, so Lightning's overhead stays small
(measured in benchmarks/bench_generate.py). A ticket's pruned weights are re-zeroed after every update
(`PrunedWeights`: one fused multiply), so they stay exactly zero.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from dpltm.data.batches import BlocksOfIndices, ShuffledBatches
from dpltm.data.types import LabeledTensors
from dpltm.devices import require_cuda_for_graphs
from dpltm.dp.cuda_graphs import capture
from dpltm.dp.distributed import Distribution
from dpltm.errors import raise_if_stopping
from dpltm.masks import Masks, PrunedWeights, trained_weights
from dpltm.progress import step_bar


class MaskedModule(L.LightningModule):
    """A network and its ticket's masks under manual optimisation (the step is the textbook
    zero_grad/backward/step, without the closure machinery automatic optimisation wraps around it): the
    pruned weights are re-zeroed after every update by `keep_pruned`, built on the trainer's device."""

    def __init__(self, model: torch.nn.Module, masks: Masks | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.masks = masks or {}
        self.keep_pruned: PrunedWeights | None = None

    def on_train_start(self) -> None:
        self.keep_pruned = PrunedWeights(self.model, self.masks)  # on the device the trainer chose

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Batches are slices of tensors (or record indices) that already live on the device: nothing to move."""
        return batch


class ClassifierModule(MaskedModule):
    """Cross-entropy classifier around a network and its ticket's masks, trained with plain SGD (manual
    optimisation: automatic optimisation's closure is a measurable share of a 4 ms step)."""

    def __init__(self, model: torch.nn.Module, lr: float, steps: int, graphed_on: LabeledTensors | None = None,
                 batch_size: int = 0, masks: Masks | None = None, snapshot_at: int | None = None) -> None:
        super().__init__(model, masks)
        self.lr = lr
        self.register_buffer("step_losses", torch.zeros(steps), persistent=False)
        self.steps_done = 0
        self.graphed_on, self.batch_size = graphed_on, batch_size
        """With data: batches come as blocks of indices into it, each step replayed from a CUDA graph."""
        self.graphed: GraphedSgdStep | None = None
        self.snapshot_at = snapshot_at
        """A step count: the weights right after that many steps are kept in `snapshot` (late rewinding)."""
        self.snapshot: dict[str, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.graphed is not None:  # a block of steps; each replay writes its loss into step_losses
            for done, row in enumerate(batch, start=self.steps_done + 1):
                raise_if_stopping()
                self.graphed.step(row)
                if done == self.snapshot_at:
                    self._keep_snapshot()
            self.steps_done += len(batch)
            return
        raise_if_stopping()
        x, y = batch
        optimizer = self._optimizer
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        optimizer.step()
        self.keep_pruned()  # type: ignore[misc]
        self.step_losses[batch_idx] = loss.detach()
        self.steps_done = batch_idx + 1
        if self.steps_done == self.snapshot_at:
            self._keep_snapshot()

    def _keep_snapshot(self) -> None:
        self.snapshot = trained_weights(self.model)

    def on_train_start(self) -> None:
        super().on_train_start()
        optimizer = self.optimizers()
        self._optimizer = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # type: ignore[union-attr]
        if self.graphed_on is not None:
            self.graphed = GraphedSgdStep(self.model, self.graphed_on, self.batch_size, self._optimizer,
                                          self.keep_pruned, losses=self.step_losses)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


class GraphedSgdStep:
    """The non-private step (gather, cross-entropy, backward, SGD step) replayed from one CUDA graph.

    The batch's record indices are copied into a static buffer; the graph gathers the records from
    the device-resident data, so a step is one copy and one replay, with no host synchronisation.
    With `losses`, the k-th replay also writes its loss to `losses[k]` (a counter on the device,
    inside the graph, reset after the capture's warm-up): no per-step indexing or copy launched from
    Python.
    """

    def __init__(self, model: torch.nn.Module, data: LabeledTensors, batch_size: int,
                 optimizer: torch.optim.Optimizer, keep_pruned: PrunedWeights | None = None,
                 losses: Tensor | None = None) -> None:
        self.model, self.data, self.optimizer = model, data, optimizer
        self.keep_pruned, self.losses = keep_pruned, losses
        device = data.labels.device
        self.index = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.loss = torch.zeros((), device=device, dtype=losses.dtype if losses is not None else torch.float32)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the next replay's row of `losses`
        # backward writes the gradients the capture allocates: they must not exist before it
        (self.graph,) = capture([self._step], modules=[model], optimizer=optimizer,
                                reset=[self.position] + ([losses] if losses is not None else []),
                                before_capture=lambda: optimizer.zero_grad(set_to_none=True))

    def _step(self) -> None:
        x = self.data.features.index_select(0, self.index)
        y = self.data.labels.index_select(0, self.index)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        if self.keep_pruned is not None:
            self.keep_pruned()
        self.loss.copy_(loss.detach())
        if self.losses is not None:  # modulo its length: the capture's warm-up runs may outnumber a short round
            self.losses.index_copy_(0, self.position, self.loss.reshape(1))
            self.position.add_(1).remainder_(self.losses.numel())

    def step(self, index: Tensor) -> Tensor:
        self.index.copy_(index, non_blocking=True)
        self.graph.replay()
        return self.loss


class _StageTqdm(Tqdm):
    """Lightning's tqdm, keeping the stage's label: Lightning renames the bar "Epoch N" at each epoch's start,
    a frame that a log of stderr shows between the stage's own."""

    label: str | None = None

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description(self.label if self.label is not None else desc, refresh)


class RoundProgressBar(TQDMProgressBar):
    """Lightning's bar, labelled with the stage it belongs to, written to **stderr**.

    Lightning's own bar writes to stdout, which would corrupt `--json` output (stdout holds
    exactly one JSON document); progress is a log, and logs go to stderr.
    """

    def __init__(self, label: str, refresh_rate: int = 50) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.label = label

    def init_train_tqdm(self) -> Tqdm:
        bar = step_bar(self.label, position=2 * self.process_position, enabled=not self.is_disabled,
                       bar_class=_StageTqdm)
        bar.label = self.label
        return bar

    def on_train_epoch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        epochs = trainer.max_epochs  # the bar's ETA is the epoch's: say which epoch of how many
        label = self.label if not epochs or epochs <= 1 else f"{self.label} epoch {trainer.current_epoch + 1}/{epochs}"
        bar = self.train_progress_bar  # made at the fit's start (`init_train_tqdm`)
        if isinstance(bar, _StageTqdm):  # before Lightning resets the bar, so that frame carries the label too
            bar.label = label
            bar.set_description(label, refresh=False)
        super().on_train_epoch_start(trainer, *args)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's info chatter and advice that does not apply to in-memory tensors."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in (".*does not have many workers.*", ".*`max_epochs` was not set.*",
                            ".*GPU available but not used.*", ".*IterableDataset.*has `__len__`.*",
                            ".*LeafSpec.*", ".*TreeSpec.*"):
                warnings.filterwarnings("ignore", pattern)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass(frozen=True)
class TrainResult:
    losses: list[float]
    """Mean training loss over each block of `log_every` steps."""
    snapshot: dict[str, Tensor] | None = None
    """The weights after `snapshot_at` steps (None when none was asked for)."""


def lightning_trainer(device: torch.device, distribution: Distribution | None = None, **kwargs: Any) -> L.Trainer:
    """A Trainer on `device` (in-memory tensors: no checkpoints, summary or validation): one device,
    or with a multi-process `distribution`, DDP over `devices` per node and `num_nodes` nodes."""
    if distribution is not None and distribution.multi_process:
        # the masks and the EMA never change across ranks: no per-step buffer broadcast
        kwargs.update(devices=distribution.devices, num_nodes=distribution.num_nodes,
                      strategy=DDPStrategy(broadcast_buffers=False), use_distributed_sampler=False)
    else:
        kwargs.setdefault("devices", [device.index or 0] if device.type == "cuda" else 1)
        plugins = list(kwargs.get("plugins") or [])
        if "strategy" not in kwargs and not any(isinstance(p, ClusterEnvironment) for p in plugins):
            environment = single_process_environment()
            if environment is not None:
                kwargs["plugins"] = [*plugins, environment]
    with quiet_lightning():
        return L.Trainer(
            accelerator="gpu" if device.type == "cuda" else device.type,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            **kwargs,
        )


MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                        "MPI_LOCALNRANKS", "ALPS_APP_PE", "PALS_RANKID")
"""What MPI launchers set in each process (Open MPI, MPICH/Intel MPI's Hydra and PMI, PMIx, MVAPICH2, Cray's ALPS
and PALS)."""


def single_process_environment() -> ClusterEnvironment | None:
    """Lightning's cluster environment for a one-process Trainer, chosen without importing mpi4py; None (Lightning
    chooses) where a launcher of its own set the process up.

    Why: to rule out an MPI launch, Lightning's Trainer imports `mpi4py.MPI` wherever mpi4py is installed, which
    starts MPI in this process: 0.9 s of a `dpltm run` on an H100 image that ships mpi4py (cProfile, 2026-11-27),
    paid again by every process, and on some clusters MPI_Init outside a launcher warns or waits. A process no
    MPI launcher started has a world of one, so Lightning's own choice there is the plain `LightningEnvironment`
    (unless TorchElastic, SLURM or LSF set it up: those checks read the environment alone and stay Lightning's)."""
    if any(name in os.environ for name in MPI_LAUNCH_VARIABLES):
        return None
    if TorchElasticEnvironment.detect() or SLURMEnvironment.detect() or LSFEnvironment.detect():
        return None
    return LightningEnvironment()


def fit_on_device(trainer: L.Trainer, module: L.LightningModule, batches: Any, device: torch.device) -> None:
    """`trainer.fit`, leaving the module where the data live.

    Lightning's teardown moves the LightningModule (and the wrapped model) to the CPU after
    `fit`, while dpltm's datasets stay on their device; every later evaluation or pruning step
    would then mix devices. This is the one place that puts the model back.
    """
    try:
        with quiet_lightning():
            trainer.fit(module, train_dataloaders=batches)
    finally:
        module.to(device)


GRAPH_BLOCK_STEPS = 500
"""Steps replayed per Lightning step in CUDA-graph mode."""


def train_classifier(model: torch.nn.Module, data: LabeledTensors, *, steps: int, batch_size: int,
                     lr: float, seed: int, log_every: int = 100, masks: Masks | None = None,
                     progress_label: str | None = None, cuda_graphs: bool = False,
                     snapshot_at: int | None = None) -> TrainResult:
    """Train `model` in place for `steps` SGD steps on device-resident `data` (with `cuda_graphs`,
    each step replayed from a CUDA graph: the same batches, the same updates). `masks` (the ticket,
    already installed by `apply_masks_`) keep their pruned weights at zero; None trains every weight.
    `snapshot_at` (1 ≤ k ≤ steps) also returns the weights after k steps (CPU copies), the iterate late
    rewinding goes back to."""
    if snapshot_at is not None and not 1 <= snapshot_at <= steps:
        raise ValueError(f"snapshot_at must lie in [1, {steps}], got {snapshot_at}")
    device = data.labels.device
    if cuda_graphs:
        require_cuda_for_graphs(device)
    shuffled = ShuffledBatches(data, batch_size, steps, seed)
    module = ClassifierModule(model, lr, steps, graphed_on=data if cuda_graphs else None,
                              batch_size=shuffled.batch_size, masks=masks, snapshot_at=snapshot_at)
    batches = torch.utils.data.DataLoader(
        BlocksOfIndices(shuffled, GRAPH_BLOCK_STEPS) if cuda_graphs else shuffled, batch_size=None, num_workers=0
    )
    callbacks = [RoundProgressBar(progress_label)] if progress_label is not None else []
    trainer = lightning_trainer(
        device,
        max_epochs=1,  # one pass over the stream, which holds exactly `steps` batches
        logger=False,
        enable_progress_bar=progress_label is not None,
        callbacks=callbacks,
        deterministic=False,
    )
    fit_on_device(trainer, module, batches, device)
    if module.steps_done != steps:
        raise RuntimeError(f"training ran {module.steps_done} steps, expected {steps}")
    losses = module.step_losses.cpu()
    blocks = [losses[i : i + log_every].mean().item() for i in range(0, steps, log_every)]
    return TrainResult(losses=blocks, snapshot=module.snapshot)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: LabeledTensors, batch_size: int = 8192) -> float:
    """Top-1 accuracy on device-resident data, accumulated by torchmetrics in batches."""
    if len(data) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    metric = MulticlassAccuracy(num_classes=model.arch.num_classes, average="micro")
    metric = metric.to(data.labels.device)
    for start in range(0, len(data), batch_size):
        metric.update(model(data.features[start : start + batch_size]),
                      data.labels[start : start + batch_size])
    model.train(was_training)
    return float(metric.compute())
