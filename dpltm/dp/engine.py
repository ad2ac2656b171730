"""The DP engine's per-sample core: masked per-sample norms, clipping and the clipped sum, for any
`nn.Module` — the API's `make_private`, the Lightning `DPCallback` and the audit use it.

A forward pass with hooks records every layer that owns trainable parameters (its inputs and its
output z); one autograd call on Σ_i ℓ_i gives g_i = ∂ℓ_i/∂z_i for every sample, because z_i influences
only ℓ_i. Where holding every layer's g at once would take more than HELD_GRADIENTS_MAX_BYTES, two backward
passes take each layer's g as it goes by instead, the norms on the first, the sums on the second.
Each layer's rule (dpltm.dp.rules: the registry — exact ghost norms for nn.Linear and
nn.Embedding, unfolded patches for convolutions, recomputed normalised inputs for GroupNorm and
LayerNorm, torch.func for any other layer) turns (a_i, g_i, mask) into the
per-sample squared norms over the surviving weights and, given the clip factors
c_i = min(1, C/‖∇ℓ_i ⊙ M‖), the clipped sum Σ_i c_i ∇ℓ_i ⊙ M (Abadi et al. 2016, Alg. 1;
docs/privacy.md §3).

Refused, in one line naming the layer: batch normalisation in training mode and running statistics
(they mix the samples of a batch, or release statistics of the private data without noise), a weight
shared by two layers, a layer run twice in one forward pass, and a layer whose output rows are not
the samples. Biases are never masked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.ghost import ClippedBatch, clip_factors, squares_times
from dpltm.dp.precision import ieee_float32
from dpltm.dp.rules import FuncRule, LayerCall, check_adds_up, rule_for
from dpltm.errors import DpltmUserError
from dpltm.masks import prunable_weights

Loss = Callable[[Tensor, Tensor], Tensor]
"""(outputs, targets) -> per-sample losses, shape (B,)."""
Clip = float | Mapping[str, float]
"""One bound C on each record's whole gradient, or per-layer bounds C_l by layer name (`layer_clip_bounds`)."""


PER_RECORD_LOSS = ("pass a loss with reduction='none' (e.g. nn.CrossEntropyLoss(reduction='none'), or "
                   "lambda out, y: F.cross_entropy(out, y, reduction='none')): each record's gradient is clipped "
                   "on its own, so the loss of each record is needed, not the batch's mean or sum")
"""What to do about a loss that reduces the batch, in every message that refuses one."""


def per_sample_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


def view_mean_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Each record's cross-entropy averaged over its K views: outputs (B, K, classes), targets (B,) → (B,).

    Augmentation multiplicity (De et al. 2022, §3): the gradient of this mean is (1/K) Σ_k ∇ℓ(view_k(x_i), y_i),
    a function of record i alone, so clipping it to C bounds that record's whole contribution, as for one view.
    The engine's rules give its exact per-record norm: a linear layer on (B, K, in) sums its K views' outer
    products per record before the norm (dpltm.dp.rules.linear)."""
    views = outputs.shape[1]
    losses = F.cross_entropy(outputs.flatten(0, 1), targets.repeat_interleave(views), reduction="none")
    return losses.view(-1, views).mean(dim=1)


def trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer that owns trainable parameters, each checked by its rule.

    Refused, in one line naming the layer: batch normalisation in training mode (even frozen: its
    batch statistics make one sample's gradient depend on the others) and any layer keeping running
    statistics in training mode (they would be released without noise); an embedding with max_norm (its
    forward rescales the looked-up rows in place); a weight shared by two layers (its gradient would be
    counted once in the sum but twice in the norm).
    """
    layers = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        label = name or type(module).__name__
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) mixes the samples of a batch, which "
                                 "per-sample clipping cannot bound: remove it, or put it in eval mode and freeze it")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has parameters not made yet (a lazy "
                                 "module): run one forward pass on public or made-up data first")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has max_norm: it renormalises, in place, "
                                 "the rows a batch looks up, a write to the weights from the records outside DP-SGD "
                                 "(trainable or not): drop max_norm")
        if module.training and bool(getattr(module, "track_running_stats", False)):
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) keeps running statistics of the "
                                 "training records, released without noise: use track_running_stats=False")
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        for parameter in own:
            if id(parameter) in seen and seen[id(parameter)] != label:
                raise DpltmUserError(f"layers {seen[id(parameter)]} and {label} share a weight: not supported by "
                                     "dpltm's per-sample clipping")
            seen[id(parameter)] = label
        if any(existing == name for existing, _ in layers):
            continue
        rule_for(module).check(label, module)
        layers.append((name, module))
    if not layers:
        raise DpltmUserError("the model has no trainable parameters")
    return layers


def prunable_weight_names(model: nn.Module) -> list[str]:
    """The weights a ticket may mask (`dpltm.masks.prunable_weights`: one rule for every network), once
    every layer is checked to be one the engine can clip (`trainable_layers`, one-line refusals)."""
    trainable_layers(model)
    return list(prunable_weights(model))


HELD_GRADIENTS_MAX_BYTES = 1 << 26
"""Above this many bytes of layer-output gradients (the batch's g for every trainable layer at once),
`clipped_gradient_sum_of` holds none of them: it takes two backward passes, the first for the norms, the second,
after the clip factors, for the sums (each layer's g used as it goes by, then freed). Opacus's ghost clipping makes
the same trade of a second backward pass for memory (Li et al. 2022, §4)."""


class _Tap:
    """Where a layer's output gradient goes as a backward pass reaches it (nowhere: g is asked of autograd)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.take: Callable[[Tensor], None] | None = None


class _Observed(torch.autograd.Function):
    """z ↦ a copy of z whose backward hands g = ∂Σℓ/∂z to the layer's tap and passes it on unchanged. Its second
    input, one anchor leaf shared by every layer, puts each layer on a path to that leaf: a backward pass to the
    anchor visits every layer and computes no weight gradient."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, anchor: Tensor, tap: _Tap) -> Tensor:
        ctx.tap, ctx.anchor_dtype = tap, anchor.dtype
        return z.clone()  # later in-place ops (ReLU(inplace=True)) act on the copy, not on z

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        if ctx.tap.take is not None:
            ctx.tap.take(g)
        return g, g.new_zeros((), dtype=ctx.anchor_dtype), None


@contextmanager
def _recording(layers: list[tuple[str, nn.Module]],
               anchor: Tensor | None = None) -> Iterator[tuple[list[LayerCall], list[_Tap]]]:
    calls = [LayerCall(name, module) for name, module in layers]
    taps = [_Tap() for _ in calls]
    handles = []
    for call, tap in zip(calls, taps):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 call: LayerCall = call, tap: _Tap = tap) -> Tensor:
            if call.output is not None:
                raise DpltmUserError(f"layer {call.name} runs twice in one forward pass: weight sharing is not "
                                     "supported by dpltm's per-sample clipping")
            call.record(module, args, kwargs, output)
            tap.nbytes = output.numel() * output.element_size()
            copy = output.clone() if anchor is None else _Observed.apply(output, anchor, tap)
            _drop_values(module, output)
            return copy
        handles.append(call.module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls, taps
    finally:
        for handle in handles:
            handle.remove()


def _drop_values(module: nn.Module, z: Tensor) -> None:
    """Let go of a layer's output values once the forward pass has its copy: z stays only as the graph's node that
    g = ∂Σℓ/∂z is asked of, and an exact rule never reads its values (torch.func's fallback does). Only for
    torch's own layers, which keep no reference to their output, and for a view only of a base made with it (a
    Linear on a sequence): a tensor anyone else holds is never touched. One copy of every layer's output less at
    the peak; what the graph saved stays saved."""
    if isinstance(rule_for(module), FuncRule) or not type(module).__module__.startswith("torch.nn."):
        return
    base = z._base
    if base is not None and (base._base is not None or base.grad_fn is None):
        return
    z.data = z.new_empty(0)
    if base is not None:
        base.data = base.new_empty(0)


def _needs_graph(calls: list[LayerCall]) -> bool:
    """Whether a layer's rule will ask its output's graph for a batch gradient (the mixing check)."""
    return any(isinstance(rule_for(c.module), FuncRule) and FuncRule.checks(c.module) for c in calls)


def _fed_the_records(call: LayerCall, x: Tensor) -> bool:
    """Whether a layer's recorded input is the batch `x` itself (or `x` flattened per row): the same
    storage, one row per sample, every value of the sample. A copy, a slice or a transformed input
    is not (its values could differ from the record's)."""
    a = call.input
    return (a is not None and a.dim() == 2 and x.is_contiguous() and a.data_ptr() == x.data_ptr()
            and a.shape[0] == x.shape[0] and a.shape[1] * a.shape[0] == x.numel() and a.is_contiguous())


def _weight_name(call: LayerCall) -> str:
    """The layer's weight as `model.named_parameters()` (and a ticket's masks) name it."""
    return f"{call.name}.weight" if call.name else "weight"


RECORD_TABLES_MAX_BYTES = 1 << 30
"""`record_norm_tables` leaves out a layer whose table would exceed this size (its norm is then computed
per batch, as without a table)."""


@dataclass(frozen=True)
class RecordTable:
    """One layer's `record_norm_tables` entry: M x_i² per record (N, out), or ‖x_i‖² (N, 1) for a dense
    weight; `masked` says which, so a step never reads a dense table for a masked layer or back."""

    terms: Tensor
    masked: bool

    def rows(self, index: Tensor) -> RecordTable:
        return RecordTable(self.terms.index_select(0, index), self.masked)


def table_rows(tables: dict[str, RecordTable], index: Tensor) -> dict[str, RecordTable]:
    """The batch's rows of every table (`index`: the batch's record indices, as for its features)."""
    return {name: table.rows(index) for name, table in tables.items()}


@torch.no_grad()
@ieee_float32()
def record_norm_tables(model: nn.Module, masks: dict[str, Tensor], records: Tensor,
                       rows_at_once: int = 8192) -> dict[str, RecordTable]:
    """For every `nn.Linear` whose input is the record itself: R[i, j] = Σ_k M_jk x_ik², each record's
    fixed share of that layer's masked ghost norm (a dense weight: the one column ‖x_i‖²).

    In ‖(g_i x_iᵀ) ⊙ M‖² = Σ_j g_ij² (M x_i²)_j the factor M x_i² depends on the record and the mask
    alone, and neither changes during training (a ticket's mask is fixed; a fixed front end's features
    are the records). Computed once per run (one N × in × out product), a step's norm of that layer is
    then a row gather and a dot product: without it a masked layer costs one (B × in) · (in × out)
    product per step and a square of the batch, which made a masked ScatterNet head 1.6× slower than
    the dense one (benchmarks/bench_masked_head.py). Keyed by layer name; the step takes the rows of
    its batch (`clipped_gradient_sum_of(input_terms=...)`), and checks at every step that the layer
    still sees the records, else it computes the norm itself.
    """
    if records.shape[0] == 0 or not records.is_contiguous():
        return {}
    probe = records[:2]
    with _recording(trainable_layers(model)) as (calls, _):
        before = probe._version
        model(probe)
    if probe._version != before:  # the network writes into its input: no layer sees the records as given
        return {}
    flat = records.reshape(records.shape[0], -1)
    tables = {}
    for call in calls:
        if not (isinstance(call.module, nn.Linear) and call.module.weight.requires_grad
                and _fed_the_records(call, probe)):
            continue
        mask = masks.get(_weight_name(call))
        columns = 1 if mask is None else mask.shape[0]
        if flat.shape[0] * columns * flat.element_size() > RECORD_TABLES_MAX_BYTES:
            continue
        operator = None if mask is None else mask.to(device=flat.device, dtype=flat.dtype).T.contiguous()
        tables[call.name] = RecordTable(squares_times(flat, operator, rows_at_once), masked=mask is not None)
    return tables


@ieee_float32()
def clipped_gradient_sum_of(model: nn.Module, x: Tensor, y: Tensor, clip: Clip,
                            masks: dict[str, Tensor] | None = None, loss: Loss = per_sample_cross_entropy,
                            weights: Tensor | None = None,
                            input_terms: dict[str, RecordTable] | None = None) -> ClippedBatch:
    """Per-sample norms over the surviving weights, clipping, and the masked clipped sum, for any
    model. `masks` maps weight names (as in `model.named_parameters()`) to 0/1 tensors; unmasked
    weights are dense. `weights` (0/1 per row) multiply the clip factors (padding rows add zero).
    `input_terms`: the batch's rows of `record_norm_tables` (made with the same masks); a layer uses
    its rows only if this step's forward pass fed it `x` itself, unchanged."""
    layers = trainable_layers(model)
    masks = masks or {}
    parameters = dict(model.named_parameters())
    if x.shape[0] == 0:  # an empty Poisson batch: a zero sum (the step still adds noise)
        return ClippedBatch({n: torch.zeros_like(p) for n, p in parameters.items() if p.requires_grad},
                            x.new_zeros(0), x.new_zeros(()))
    anchor = torch.zeros((), device=x.device, requires_grad=True)
    with _recording(layers, anchor) as (calls, taps):
        before = x._version
        outputs = model(x)
    if input_terms and x._version == before:  # written in place: the tables no longer describe x
        for call in calls:
            table = input_terms.get(call.name)
            masked = _weight_name(call) in masks
            if (table is not None and table.masked == masked and table.terms.shape[0] == x.shape[0]
                    and _fed_the_records(call, x)):
                call.input_terms = table.terms
    losses = loss(outputs, y)
    if losses.shape != (x.shape[0],):
        raise DpltmUserError(f"the loss must give one value per record of the batch, shape ({x.shape[0]},) for "
                             f"this batch of {x.shape[0]}; got shape {tuple(losses.shape)}: {PER_RECORD_LOSS}")
    loss_sum = losses.sum()
    for call in calls:
        if call.output is None:
            raise DpltmUserError(f"layer {call.name} has trainable parameters but took no part in the forward pass")
    if _holding_costs_too_much(calls, taps):
        sums, norms = _clip_and_sum_in_two_passes(calls, taps, loss_sum, anchor, masks, clip, weights, x.shape[0])
    else:
        out_grads = torch.autograd.grad(loss_sum, [call.output for call in calls], allow_unused=True,  # type: ignore[misc]
                                        retain_graph=_needs_graph(calls))
        _check_used(calls, out_grads)
        sums, norms = clip_and_sum(calls, list(out_grads), masks, clip, weights, batch_size=x.shape[0])
    order = [name for name, p in parameters.items() if p.requires_grad]
    return ClippedBatch({name: sums[name] for name in order}, norms, loss_sum.detach())


def _check_used(calls: list[LayerCall], grads: list[Any]) -> None:
    unused = [call.name for call, g in zip(calls, grads) if g is None]
    if unused:
        raise DpltmUserError(f"the loss does not depend on layer(s) {unused}: every trainable layer must take part")


def _holding_costs_too_much(calls: list[LayerCall], taps: list[_Tap]) -> bool:
    """Whether to take two backward passes: the layers' output gradients together exceed
    HELD_GRADIENTS_MAX_BYTES, and every layer has an exact rule (torch.func's fallback asks the graph for more)."""
    return (sum(tap.nbytes for tap in taps) > HELD_GRADIENTS_MAX_BYTES
            and not any(isinstance(rule_for(call.module), FuncRule) for call in calls))


def _clip_and_sum_in_two_passes(calls: list[LayerCall], taps: list[_Tap], loss_sum: Tensor, anchor: Tensor,
                                masks: dict[str, Tensor], clip: Clip, weights: Tensor | None,
                                batch: int) -> tuple[dict[str, Tensor], Tensor]:
    """`clip_and_sum` holding no layer's output gradient: the first backward pass takes each layer's norms as its
    g goes by, the second its clipped sums, with the clip factors the first pass's norms gave. The same code on the
    same g (recomputed by the same kernels) as the one pass: the same norms, factors and sums."""
    layers: list[_LayerNorms | None] = [None] * len(calls)

    def norms_of(index: int) -> Callable[[Tensor], None]:
        def take(g: Tensor) -> None:
            _check_rows(calls[index], g, batch)
            layers[index] = _LayerNorms.of(calls[index], g, masks)
        return take

    for call in calls:
        call.hold_for_sum = False
    try:
        for index, tap in enumerate(taps):
            tap.take = norms_of(index)
        torch.autograd.grad(loss_sum, anchor, retain_graph=True, allow_unused=True)
        _check_used(calls, layers)
        found = [layer for layer in layers if layer is not None]
        dtype = torch.float64 if any(call.output is not None and call.output.dtype == torch.float64
                                     for call in calls) else torch.float32
        clipping = _Clipping.of(found, clip, weights, dtype)
        sums: dict[str, Tensor] = {}

        def sums_of(index: int) -> Callable[[Tensor], None]:
            def take(g: Tensor) -> None:
                sums.update(clipping.layer_sums(calls[index], g, found[index]))
            return take

        for index, tap in enumerate(taps):
            tap.take = sums_of(index)
        torch.autograd.grad(loss_sum, anchor)
        return sums, clipping.norms
    finally:  # a tap's closure reaches the graph that reaches the tap: a cycle through autograd's nodes, which
        for tap in taps:  # Python's collector cannot see, would keep the graph and its activations alive
            tap.take = None


@torch.no_grad()
def clip_and_sum(calls: list[LayerCall], out_grads: list[Tensor], masks: dict[str, Tensor], clip: Clip,
                 weights: Tensor | None = None, batch_size: int | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Per-sample norms over the surviving weights, clip factors, and the masked clipped sums, from
    each layer's recorded inputs and per-sample output gradient (keyed by parameter name).

    Per-layer bounds (`clip` a mapping): each layer's part of a record's gradient is clipped to its own C_l, so the
    record's whole gradient has norm ≤ √(Σ_l C_l²), the sensitivity the noise is scaled to (McMahan et al. 2018,
    §3, per-layer clipping). The returned norms are the whole gradients' either way."""
    batch = out_grads[0].shape[0] if batch_size is None else batch_size
    for call, g in zip(calls, out_grads):  # dimension 0 must be the sample everywhere
        _check_rows(call, g, batch)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in out_grads) else torch.float32
    layers = [_LayerNorms.of(call, g, masks) for call, g in zip(calls, out_grads)]
    clipping = _Clipping.of(layers, clip, weights, dtype)
    sums: dict[str, Tensor] = {}
    for call, g, layer in zip(calls, out_grads, layers):
        sums.update(clipping.layer_sums(call, g, layer))
    return sums, clipping.norms


def _check_rows(call: LayerCall, g: Tensor, batch: int) -> None:
    if call.input is None or call.input.shape[0] != batch or g.shape[0] != batch:
        raise DpltmUserError(f"layer {call.name} does not see one row per sample in dimension 0 (batch {batch}): "
                             "dpltm's per-sample clipping needs batch-first layers, without reshaping samples "
                             "into rows")


@dataclass(frozen=True)
class _LayerNorms:
    """One layer's per-sample squared norms over its surviving weights, and what its rule keeps for the sum."""

    rule: Any
    masks: dict[str, Tensor]
    state: Any
    sq_norms: Tensor

    @classmethod
    def of(cls, call: LayerCall, g: Tensor, masks: dict[str, Tensor]) -> _LayerNorms:
        rule, local = rule_for(call.module), _local_masks(call, masks, g)
        sq_norms, state = rule.sq_norms(call, g, local)
        return cls(rule, local, state, sq_norms)


@dataclass(frozen=True)
class _Clipping:
    """The batch's norms and clip factors, from every layer's squared norms (added in the layers' order)."""

    norms: Tensor
    finite: Tensor | None
    whole: Tensor | None
    clip: Clip
    weights: Tensor | None
    dtype: torch.dtype

    @classmethod
    def of(cls, layers: list[_LayerNorms], clip: Clip, weights: Tensor | None, dtype: torch.dtype) -> _Clipping:
        sq_norms = layers[0].sq_norms.new_zeros(layers[0].sq_norms.shape[0], dtype=dtype)
        for layer in layers:
            sq_norms += layer.sq_norms.to(dtype)
        norms = sq_norms.sqrt()
        finite: Tensor | None = torch.isfinite(norms)
        if bool(finite.all()):  # the one host synchronisation: the rules then skip zeroing rows
            finite = None
        whole = None if isinstance(clip, Mapping) else _weighted(clip_factors(norms, clip), weights, dtype)
        return cls(norms, finite, whole, clip, weights, dtype)

    def layer_sums(self, call: LayerCall, g: Tensor, layer: _LayerNorms) -> dict[str, Tensor]:
        """The layer's masked clipped sums, by parameter name."""
        factors = self.whole
        if factors is None:  # per-layer bounds; a record not finite in any layer is dropped from every layer
            factors = clip_factors(layer.sq_norms.to(self.dtype).sqrt(), self.clip[call.name])  # type: ignore[index]
            factors = _weighted(factors if self.finite is None else factors * self.finite, self.weights, self.dtype)
        prefix = f"{call.name}." if call.name else ""
        return {prefix + local_name: total for local_name, total in
                layer.rule.clipped_sums(call, g, factors, self.finite, layer.masks, layer.state).items()}


def _weighted(factors: Tensor, weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Clip factors times the rows' weights (0 for a padding row), kept in float32 or wider: rounding them to bf16
    could push a clipped norm past C."""
    return (factors if weights is None else factors * weights).to(dtype)


def clip_and_sum_in_chunks(calls: list[LayerCall], out_grads: list[Tensor], masks: dict[str, Tensor], clip: Clip,
                           batch_size: int, rows: int | None) -> dict[str, Tensor]:
    """`clip_and_sum`'s masked clipped sums, formed at most `rows` rows at a time (None: all at once) from
    layers recorded on the whole batch: each chunk's sums are added up, and a layer not known to be per-sample
    is checked once, on the batch's total against its batch gradient (`batch_grads`, which must be set)."""
    if rows is None or batch_size <= rows:
        return clip_and_sum(calls, out_grads, masks, clip, batch_size=batch_size)[0]
    totals: list[dict[str, Tensor]] = [{} for _ in calls]
    sums: dict[str, Tensor] = {}
    for start in range(0, batch_size, rows):
        part = slice(start, start + rows)
        chunk = [replace(call, inputs=_rows_of(call.inputs or (), part, batch_size),
                         kwargs=dict(zip(call.kwargs, _rows_of(tuple(call.kwargs.values()), part, batch_size))),
                         input_terms=None if call.input_terms is None else call.input_terms[part], totals=total)
                 for call, total in zip(calls, totals)]
        chunk_sums, _ = clip_and_sum(chunk, [g[part] for g in out_grads], masks, clip,
                                     batch_size=min(rows, batch_size - start))
        for name, total in chunk_sums.items():
            if name in sums:
                sums[name].add_(total)
            else:
                sums[name] = total
    for call, g, total in zip(calls, out_grads, totals):
        if total:
            check_adds_up(call, g, total, _local_masks(call, masks, g))
    return sums


def _rows_of(values: tuple[Any, ...], part: slice, batch_size: int) -> tuple[Any, ...]:
    """The rows `part` of every tensor with one row per sample; anything else as it is."""
    return tuple(v[part] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == batch_size else v for v in values)


def _local_masks(call: LayerCall, masks: dict[str, Tensor], like: Tensor) -> dict[str, Tensor]:
    """The layer's masks by local parameter name, as float tensors on its gradient's device."""
    prefix = f"{call.name}." if call.name else ""
    local = {}
    for local_name, parameter in call.module.named_parameters(recurse=False):
        mask = masks.get(prefix + local_name)
        if mask is not None and parameter.requires_grad:
            local[local_name] = mask.to(device=like.device, dtype=parameter.dtype)
    return local
