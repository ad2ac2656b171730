"""One DP-SGD step on a masked network, as a pure-ish function of (model, batch, generator).

    ĝ = (Σ_i clip_C(∇ℓ_i) ⊙ M + noise ⊙ M) / L

with L the *expected* batch size q·N (what the Poisson accountant assumes; dividing by the
realised batch size would leak it). The optimiser then applies ĝ; pruned coordinates get a
zero gradient and no noise, so they stay exactly zero (element-wise optimisers: SGD, momentum, Adam).

The per-sample part runs one of two ways, chosen by the layout: the LeNet family's fused step
(`MaskLayout`, dpltm.dp.ghost), or the DP engine's per-layer rules for any other `nn.Module`
(`EngineLayout`, dpltm.dp.engine); each with a per-record norm table for the layers fed the records
themselves (`record_terms`, computed once per run). Both give the
masked per-sample norms and the masked clipped sum; the noise and the division by L are one function
(`noisy_mean`) for every front end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dpltm.dp.engine import RecordTable, clipped_gradient_sum_of, record_norm_tables, table_rows
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum, first_layer_input_terms
from dpltm.dp.mechanism import NoiseMechanism
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

    @classmethod
    def of(cls, model: nn.Module, masks: Masks) -> EngineLayout:
        device = next(model.parameters()).device
        pruning = {n: m.to(device=device, dtype=torch.bool) for n, m in masks.items() if not bool(m.all())}
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
                allow_sparse: bool = True) -> MaskLayout | EngineLayout:
    """The layout a DP step uses for `model` and its ticket `masks` (None: dense): the fused step's for
    the LeNet family and ScatterNet's fully connected heads (`takes_fused_step`) with every layer trained, the
    engine's for any other network or one with frozen layers
    (which takes no noise geometry `scales`)."""
    masks = masks if masks is not None else full_masks(model)
    if takes_fused_step(model) and all(p.requires_grad for p in model.parameters()):
        return MaskLayout.of(model, masks, dtype, scales, allow_sparse)  # frozen layers: the engine's rules
    if scales and any(s is not None for s in scales.values()):
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


def private_gradients(model: nn.Module, x: Tensor, y: Tensor, *, clip: float,
                      noise: NoiseMechanism, expected_batch_size: float,
                      generator: torch.Generator,
                      layout: MaskLayout | EngineLayout,
                      reduce: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
                      input_terms: Tensor | dict[str, RecordTable] | None = None, add_noise: bool = True,
                      extra_sums: dict[str, Tensor] | None = None,
                      ) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """ĝ per parameter, plus the per-sample norms and the summed loss (for logging only).

    `layout` is the ticket's `step_layout(model, masks)`, computed once per run (masks are fixed).
    `reduce` sums the ranks' sums in a multi-device run (dpltm.dp.distributed.all_reduce_sum), after
    rank 0 alone (`add_noise`) has added the noise: the reduced sum carries exactly one draw.
    `input_terms`: the batch's rows of the per-record norm tables (computed once per run,
    `record_terms`): `first_layer_input_terms` for the fused layout, `record_norm_tables` for the engine's.
    `extra_sums`: clipped gradients of records that are not rows of `x` (an audit's gradient
    canaries, dpltm.audit.canaries), added to the clipped sum before the noise.
    """
    if isinstance(layout, EngineLayout):
        tables = input_terms if isinstance(input_terms, dict) else None
        batch = clipped_gradient_sum_of(model, x, y, clip, layout.masks, input_terms=tables)
    else:
        terms = input_terms if isinstance(input_terms, Tensor) else None
        batch = clipped_gradient_sum(model, x, y, clip, layout, input_terms=terms)
    for name, extra in (extra_sums or {}).items():
        batch.grad_sums[name].add_(extra)
    grads = noisy_mean(batch.grad_sums, noise=noise, surviving=layout.surviving, clip=clip,
                       expected_batch_size=expected_batch_size, generator=generator, reduce=reduce,
                       add_noise=add_noise)
    return grads, batch.norms, batch.loss_sum


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
