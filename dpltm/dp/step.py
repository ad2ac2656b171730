"""One DP-SGD step on a masked network, in one place: `DpSgdStep`.

    ĝ = (Σ_i clip_C(∇ℓ_i) ⊙ M + noise ⊙ M) / L

with L the *expected* batch size q·N (what the Poisson accountant assumes; dividing by the
realised batch size would leak it). The optimiser then applies ĝ; pruned coordinates get a
zero gradient and no noise, so they stay exactly zero (element-wise optimisers: SGD, momentum, Adam).

Every front end runs `DpSgdStep`: the CLI's Lightning stage (dpltm.training.private), `make_private`
(dpltm.private_training), the noise-aware choice's candidates one by one (dpltm.selection.noise_aware)
and, from the clipped sums on, `DPCallback` (dpltm.lightning), whose sums come from Lightning's backward.
The static-shape and CUDA-graph step (dpltm.dp.graphed) shares `noisy_mean`.

The per-sample part runs one of two ways, chosen by the layout: the LeNet family's fused step
(`MaskLayout`, dpltm.dp.ghost), or the DP engine's per-layer rules for any other `nn.Module`
(`EngineLayout`, dpltm.dp.engine); each with a per-record norm table for the layers fed the records
themselves (`record_terms`, computed once per run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from dpltm.dp.averaging import Ema, update_average
from dpltm.dp.engine import (
    Clip,
    Loss,
    RecordTable,
    clipped_gradient_sum_of,
    per_sample_cross_entropy,
    record_norm_tables,
    table_rows,
)
from dpltm.dp.ghost import ClippedBatch, MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.dp.mechanism import NoiseMechanism
from dpltm.dp.noise_filter import NoiseFilter
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks, full_masks
from dpltm.networks.lenet import LeNet


@dataclass(frozen=True)
class EngineLayout:
    """A ticket over any `nn.Module`, as the DP engine takes it: the masks that prune something (keyed by
    parameter name, on the model's device; a weight whose mask keeps everything is dense and takes the
    plain ghost norm, not the masked one), and each parameter's surviving flat indices (None: all
    survive), for the noise."""

    masks: dict[str, Tensor]
    surviving: dict[str, Tensor | None]

    def __post_init__(self) -> None:
        # the rules multiply by float masks: converted once here, not per layer at every step (and not held twice
        # from the norms to the sums)
        object.__setattr__(self, "masks", {n: m if m.is_floating_point() else m.to(torch.float32)
                                           for n, m in self.masks.items()})

    @classmethod
    def of(cls, model: nn.Module, masks: Masks) -> EngineLayout:
        """Each mask on its parameter's device (a user's model may span several)."""
        parameters = dict(model.named_parameters())
        device = next(iter(parameters.values())).device
        pruning = {n: m.to(device=parameters[n].device if n in parameters else device, dtype=torch.bool)
                   for n, m in masks.items() if not bool(m.all())}
        surviving: dict[str, Tensor | None] = {}
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                mask = pruning.get(name)
                surviving[name] = None if mask is None else mask.flatten().nonzero().squeeze(1)
        return cls(pruning, surviving)


def takes_fused_step(model: nn.Module) -> bool:
    """The LeNet family, and a ScatterNet linear or MLP head over its cached features (a chain of linear
    layers, `fully_connected`): the fused ghost-norm step (dpltm.dp.ghost), which also runs static-shape and in
    CUDA graphs. Any other network trains through the DP engine's per-layer rules."""
    return isinstance(model, LeNet) or bool(getattr(model, "fully_connected", False))


def step_layout(model: nn.Module, masks: Masks | None, dtype: torch.dtype = torch.float32,
                scales: dict[str, Tensor | None] | None = None,
                allow_sparse: bool = True, views: int = 1) -> MaskLayout | EngineLayout:
    """The layout a DP step uses for `model` and its ticket `masks` (None: dense): the fused step's for
    the LeNet family and ScatterNet's fully connected heads (`takes_fused_step`) with every layer trained, the
    engine's for any other network, one with frozen layers
    (which takes no noise geometry `scales`), or records of `views` > 1 views each (augmentation multiplicity):
    the fused step's ghost norm ‖g_i a_iᵀ ⊙ M‖ is for one input row per record, while the engine's linear rule
    takes (B, K, in) and gives the exact norm of the sum of a record's K outer products."""
    masks = masks if masks is not None else full_masks(model)
    if views == 1 and takes_fused_step(model) and all(p.requires_grad for p in model.parameters()):
        return MaskLayout.of(model, masks, dtype, scales, allow_sparse)  # frozen layers: the engine's rules
    if scales and any(s is not None for s in scales.values()):
        if views > 1:
            raise DpltmUserError("noise geometries (dpd, shaped) shape the fused step's layers, one view per record: "
                                 "--augmult trains with --noise gaussian")
        raise DpltmUserError("noise geometries (dpd, shaped) shape the MLP's layers (--arch mlp); this network "
                             "trains with --noise gaussian")
    return EngineLayout.of(model, masks)


RecordTerms = Tensor | dict[str, RecordTable]
"""A run's per-record norm tables: the fused layout's `first_layer_input_terms`, the engine's
`record_norm_tables`."""


def record_terms(model: nn.Module, layout: MaskLayout | EngineLayout, records: Tensor) -> RecordTerms | None:
    """Each record's fixed share of the masked norm of the layers fed the records themselves, computed
    once per run (masks never change during training); None where no layer qualifies."""
    if isinstance(layout, EngineLayout):
        return record_norm_tables(model, layout.masks, records) or None
    return first_layer_input_terms(records, layout)


def terms_of_batch(terms: RecordTerms | None, index: Tensor) -> RecordTerms | None:
    """The rows of `terms` for the batch whose record indices are `index`."""
    if terms is None:
        return None
    return table_rows(terms, index) if isinstance(terms, dict) else terms.index_select(0, index)


Reduce = Callable[[dict[str, Tensor]], dict[str, Tensor]]
"""Sums the ranks' noisy sums in a multi-device run (dpltm.dp.distributed.all_reduce_sum)."""


def clipped_batch(model: nn.Module, layout: MaskLayout | EngineLayout, x: Tensor, y: Tensor, clip: Clip,
                  input_terms: RecordTerms | None = None, loss: Loss = per_sample_cross_entropy) -> ClippedBatch:
    """The masked clipped sum of the batch (x, y), its per-sample norms and summed loss, by the layout's step:
    the fused ghost-norm step (`MaskLayout`, cross-entropy) or the DP engine's rules (`EngineLayout`, `loss`).
    `input_terms`: the batch's rows of the run's per-record norm tables (`record_terms`)."""
    if isinstance(layout, EngineLayout):
        tables = input_terms if isinstance(input_terms, dict) else None
        return clipped_gradient_sum_of(model, x, y, clip, layout.masks, loss, input_terms=tables)
    if not isinstance(clip, (int, float)):
        raise DpltmUserError("per-layer clipping runs on the engine's layers (make_private), not the fused step")
    terms = input_terms if isinstance(input_terms, Tensor) else None
    return clipped_gradient_sum(model, x, y, clip, layout, input_terms=terms)


def private_gradients(model: nn.Module, x: Tensor, y: Tensor, *, clip: float,
                      noise: NoiseMechanism, expected_batch_size: float,
                      generator: torch.Generator,
                      layout: MaskLayout | EngineLayout,
                      reduce: Reduce | None = None,
                      input_terms: RecordTerms | None = None, add_noise: bool = True,
                      extra_sums: dict[str, Tensor] | None = None,
                      ) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """ĝ per parameter, plus the per-sample norms and the summed loss (for logging only): `DpSgdStep`'s
    sums and noisy mean on one batch, for a caller that wants the norms too (tests, benchmarks)."""
    batch = clipped_batch(model, layout, x, y, clip, input_terms)
    for name, extra in (extra_sums or {}).items():
        batch.grad_sums[name].add_(extra)
    grads = noisy_mean(batch.grad_sums, noise=noise, surviving=layout.surviving, clip=clip,
                       expected_batch_size=expected_batch_size, generator=generator, reduce=reduce,
                       add_noise=add_noise)
    return grads, batch.norms, batch.loss_sum


@dataclass(frozen=True)
class DpSgdStep:
    """One DP-SGD step on a masked network, the one every front end runs (Abadi et al. 2016, Alg. 1):

        ĝ = (Σ_i clip_C(∇ℓ_i) ⊙ M + noise ⊙ M) / L,  then the optimiser, then the hooks.

    A front end supplies its batch (rows x, y and, for the per-record norm tables `terms`, their record
    indices), its hooks and its bookkeeping; a front end whose sums come from elsewhere (Lightning's own
    backward: `DPCallback`) enters at `noisy_gradients`.

    `max_physical_batch_size` bounds the rows whose per-sample work runs at once: the Poisson batch is
    processed in chunks of at most that many rows and their clipped sums added before the one noise draw.
    ĝ is the same function of the batch (the Gaussian mechanism on a sum of sensitivity C, Abadi et al. 2016,
    Alg. 1 and Thm. 1), computed in another order of additions, so the mechanism and ε are the same.

    `noise_filter`: the optimiser reads the low-pass filtered m̂ of the released ĝ sequence instead of ĝ (DOPPLER,
    dpltm.dp.noise_filter): post-processing of ĝ alone, so the mechanism and ε are unchanged.

    `optimizer` None: ĝ is installed and the caller steps (one optimiser over many candidates).
    `before_update` runs before the optimiser may move a weight (the ledger counts the step there), and
    `after_update` after it, even when it raised (re-masking pruned weights to exactly zero). `averager`
    with `ema`: the moving average of the released iterates, post-processing (docs/privacy.md §7).
    `reduce` and `add_noise`: under DDP rank 0 alone adds the draw and the ranks' sums are all-reduced."""

    model: nn.Module
    layout: MaskLayout | EngineLayout
    clip: float
    noise: NoiseMechanism
    expected_batch_size: float
    generator: torch.Generator
    optimizer: torch.optim.Optimizer | None = None
    loss: Loss = per_sample_cross_entropy
    terms: RecordTerms | None = None
    reduce: Reduce | None = None
    add_noise: bool = True
    max_physical_batch_size: int | None = None
    before_update: Callable[[], None] | None = None
    after_update: Callable[[], None] | None = None
    averager: AveragedModel | None = None
    ema: Ema | None = None
    noise_filter: NoiseFilter | None = None
    layer_clips: Mapping[str, float] | None = None
    """Per-layer bounds C_l (the engine's layouts only): each layer's part of a record's gradient clipped to its own,
    `clip` being √(Σ C_l²), the sensitivity the noise is scaled to (dpltm.dp.engine.clip_and_sum)."""

    @property
    def sum_clip(self) -> Clip:
        """The bound the clipped sums use: per layer where given, else `clip`."""
        return self.clip if self.layer_clips is None else self.layer_clips

    def clipped_sums(self, x: Tensor, y: Tensor, index: Tensor | None = None,
                     terms: RecordTerms | None = None) -> dict[str, Tensor]:
        """Σ_i clip_C(∇ℓ_i) ⊙ M over the batch (x, y), in chunks of at most `max_physical_batch_size` rows.
        `index`: the rows' record indices, for the rows of the norm tables (`terms`, else the step's own)."""
        terms = self.terms if terms is None else terms
        rows, limit = x.shape[0], self.max_physical_batch_size
        if limit is None or rows <= limit:
            batch_terms = None if index is None else terms_of_batch(terms, index)
            return clipped_batch(self.model, self.layout, x, y, self.sum_clip, batch_terms, self.loss).grad_sums
        sums: dict[str, Tensor] = {}
        for start in range(0, rows, limit):
            part = slice(start, start + limit)
            part_terms = None if index is None else terms_of_batch(terms, index[part])
            chunk = clipped_batch(self.model, self.layout, x[part], y[part], self.sum_clip, part_terms, self.loss)
            for name, total in chunk.grad_sums.items():
                if name in sums:
                    sums[name].add_(total)
                else:
                    sums[name] = total
        return sums

    def noisy_gradients(self, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """ĝ from the masked clipped sums (modified in place): one noise draw, over L (`noisy_mean`)."""
        return noisy_mean(sums, noise=self.noise, surviving=self.layout.surviving, clip=self.clip,
                          expected_batch_size=self.expected_batch_size, generator=self.generator,
                          reduce=self.reduce, add_noise=self.add_noise)

    def gradients(self, x: Tensor, y: Tensor, index: Tensor | None = None, *, terms: RecordTerms | None = None,
                  extra_sums: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """ĝ for the batch (x, y). `extra_sums`: clipped gradients of records that are not rows of `x` (an
        audit's gradient canaries, dpltm.audit.canaries), added to the clipped sum before the noise."""
        sums = self.clipped_sums(x, y, index, terms)
        for name, extra in (extra_sums or {}).items():
            sums[name].add_(extra)
        return self.noisy_gradients(sums)

    def apply(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Install ĝ (or, with a noise filter, its filtered m̂: from the released ĝ only) and, with an optimiser,
        step it between the hooks (`apply_gradients`); then the average. Returns the gradients installed."""
        installed = grads if self.noise_filter is None else self.noise_filter.step(grads)
        if self.optimizer is None:
            install_gradients(self.model, installed)
            return installed
        apply_gradients(self.model, installed, self.optimizer, before_update=self.before_update,
                        after_update=self.after_update)
        if self.averager is not None and self.ema is not None:  # from the released iterate only
            update_average(self.averager, self.model, self.ema)
        return installed

    def step(self, x: Tensor, y: Tensor, index: Tensor | None = None, *,
             terms: RecordTerms | None = None) -> dict[str, Tensor]:
        """One DP-SGD step on the Poisson batch (x, y) (record indices `index`); returns the released ĝ."""
        grads = self.gradients(x, y, index, terms=terms)
        self.apply(grads)
        return grads


def noisy_mean(sums: dict[str, Tensor], *, noise: NoiseMechanism, surviving: dict[str, Tensor | None], clip: float,
               expected_batch_size: float, generator: torch.Generator,
               reduce: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None, add_noise: bool = True,
               out: dict[str, Tensor] | None = None,
               out_scales: dict[str, Tensor | float] | None = None) -> dict[str, Tensor]:
    """ĝ = (Σ_i clip_C(∇ℓ_i) ⊙ M + one noise draw on the surviving coordinates) / L: the one place every
    DP-SGD front end (the CLI's training, CUDA graphs, `make_private`, `DPCallback`) adds its noise.

    `sums` are the masked clipped sums (modified in place), or unmasked ones with `out_scales` holding
    the masks. L is the *expected* batch size q·N, what the Poisson-subsampled Gaussian accountant
    assumes (Abadi et al. 2016, Alg. 1; dividing by the realised size would leak it). Under DDP rank 0
    alone adds the draw (`add_noise`), then `reduce` all-reduces, so the reduced sum carries exactly one
    draw (docs/privacy.md §7). `out`: write ĝ into these tensors (static buffers for CUDA graphs) instead
    of returning the scaled sums; `out_scales` (with `out` only): per parameter, the factor ĝ is written
    with instead of 1/L — the mask over L for sums built without the mask
    (`clipped_gradient_sum(..., mask_sums=False)`: the noise is on surviving coordinates only, so masking
    after it is the same ĝ), in the one multiply the scaling costs anyway.
    """
    if out_scales is not None and out is None:
        raise ValueError("out_scales (the masks of unmasked sums) needs out: ĝ is masked as it is written there")
    noisy = noise.perturb(sums, surviving, clip, generator) if add_noise else sums
    if reduce is not None:
        noisy = reduce(noisy)
    scale = 1.0 / expected_batch_size
    if out is None:
        return {name: total.mul_(scale) for name, total in noisy.items()}
    for name, grad in out.items():
        factor = scale if out_scales is None else out_scales[name]
        torch.mul(noisy[name], factor, out=grad)
        if isinstance(factor, Tensor):  # a pruned entry set, not multiplied: its unmasked sum is not bounded
            grad.masked_fill_(factor == 0, 0.0)  # by the clipping, and inf·0 would be NaN
    return out


def check_steps_left(steps_taken: int, planned: int) -> None:
    """Refuse a step past the plan: σ was calibrated for `planned` steps, so one more would spend beyond the budget."""
    if steps_taken >= planned:
        raise DpltmUserError(f"the planned {planned} steps are done: the privacy budget is spent")


def install_gradients(model: nn.Module, grads: dict[str, Tensor]) -> None:
    """Put ĝ in .grad of every trainable parameter (overwriting: no stale gradient survives). A frozen
    parameter (`requires_grad=False`: fixed at public weights) gets none and is not updated."""
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.grad = grads[name]


def apply_gradients(model: nn.Module, grads: dict[str, Tensor], optimizer: torch.optim.Optimizer, *,
                    before_update: Callable[[], None] | None = None,
                    after_update: Callable[[], None] | None = None) -> None:
    """The end of every DP step: install ĝ, step the optimiser, clear .grad.

    `before_update` runs before the optimiser may move a weight (the ledger counts the step there: an
    interruption inside `optimizer.step()` may leave the update in the weights, so the count must already
    hold it); `after_update` runs after it, even when it raised (re-masking the pruned weights to exactly
    zero, noting who stepped them)."""
    install_gradients(model, grads)
    if before_update is not None:
        before_update()
    try:
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        if after_update is not None:
            after_update()
