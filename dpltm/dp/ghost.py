"""Per-sample gradient norms and clipped gradient sums for a masked MLP, without per-sample
gradient tensors.

For a linear layer z = (W ⊙ M) a + b, sample i's weight gradient is (g_i a_iᵀ) ⊙ M with
g_i = ∂ℓ_i/∂z_i. Its squared norm over the *surviving* weights is

    ‖(g_i a_iᵀ) ⊙ M‖² = Σ_jk g_ij² M_jk a_ik² = (g_i ⊙ g_i)ᵀ M (a_i ⊙ a_i)

— one batched matmul per layer (the "ghost norm" of Goodfellow 2015 / Li et al. 2022,
restricted to the mask; docs/privacy.md §3). The unmasked bias adds ‖g_i‖². With clip
factors c_i = min(1, C/‖g_i‖), the clipped sum Σ_i c_i g_i a_iᵀ is (c ⊙ G)ᵀ A: the same
matmul a plain backward pass does. So a DP step costs one extra matmul per layer.

Output gradients come from one autograd call on Σ_i ℓ_i with respect to the pre-activations:
z_i influences only ℓ_i, so ∂(Σ ℓ)/∂z_i = ∂ℓ_i/∂z_i. Nothing here depends on the activation
between layers (ReLU, tanh, ...): it only shapes g_i and the next layer's input a_i, both of which
autograd and the forward pass give per sample, so the identity holds for any elementwise one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dpltm.dp.precision import ieee_float32
from dpltm.dp.rules import conv2d_weight_grads
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks
from dpltm.networks.lenet import LeNet


@dataclass(frozen=True)
class MaskLayout:
    """What a DP step needs to know about the masks, computed once per training run.

    `norm_masks[l]` is layer l's mask (divided by s² under a noise geometry s) laid out for the
    norm matmul (see `dpltm.dp.rules.masked_sq_norms`), None for a dense unscaled layer;
    `bias_weights[l]` is 1/s² for a scaled bias; `weight_masks[l]` the float mask for the
    clipped sum; `surviving[name]` the flat indices of a parameter's surviving coordinates
    (None: all survive), so noise is drawn only where it can act.
    """

    norm_masks: list[Tensor | None]
    weight_masks: list[Tensor | None]
    surviving: dict[str, Tensor | None]
    bias_weights: list[Tensor | None]
    parameter_names: list[tuple[str, str]]
    """(weight, bias) parameter names per layer, input to output."""
    sum_masks: list[Tensor | None]
    """CSR 0/1 mask for sparse big layers: their clipped sum is computed only where it survives
    (sampled dense-dense matmul), None for the rest."""
    conv_parameter_names: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(weight, bias) names of the convolutional front's layers."""
    conv_masks: list[Tensor | None] = dataclasses.field(default_factory=list)
    """Each convolution's float mask (None: dense), for its per-sample weight gradients."""
    bias_terms: list[Tensor] = dataclasses.field(default_factory=list)
    """Per layer, each output unit's bias share of the squared norm per unit of g_ij²: ones, or 1/s²
    under a noise geometry (`bias_weights`, never None here), so a layer's whole norm is one row dot
    product Σ_j g_ij² (M a_i² + b)_j (`layer_norm_terms`)."""

    @functools.cached_property
    def pruned_masks(self) -> list[Tensor | None]:
        """Per layer, True where a weight is pruned (None: dense): where a masked sum is set to 0, made once."""
        return [None if mask is None else mask == 0 for mask in self.weight_masks]

    @property
    def all_parameter_names(self) -> list[str]:
        """Every parameter's name in the order the step builds its sums (convolutions first)."""
        return [name for pair in (*self.conv_parameter_names, *self.parameter_names) for name in pair]

    @classmethod
    def of(cls, model: LeNet, masks: Masks, dtype: torch.dtype = torch.float32,
           scales: dict[str, Tensor | None] | None = None, allow_sparse: bool = True) -> MaskLayout:
        """The layout of `masks` (the ticket beside `model`, keyed by mask name) over the model's layers.
        `scales` (per-parameter, positive) turn the clipping norm into ‖g / s‖: a noise plug-in
        that adds N(0, σ²C²s²) is then exactly the Gaussian mechanism in the rescaled space.
        `allow_sparse=False` keeps every product dense (sparse kernels do not go into CUDA graphs)."""
        norm_masks: list[Tensor | None] = []
        weight_masks: list[Tensor | None] = []
        bias_weights: list[Tensor | None] = []
        sum_masks: list[Tensor | None] = []
        bias_terms: list[Tensor] = []
        names: list[tuple[str, str]] = []
        surviving: dict[str, Tensor | None] = {}
        scales = scales or {}
        device = next(model.parameters()).device
        for mask_name, _ in model.layers_in_order():
            mask = masks[mask_name].to(device=device, dtype=torch.bool)
            weight_name, bias_name = mask_name, f"{mask_name.removesuffix('.weight')}.bias"
            names.append((weight_name, bias_name))
            weight_scale, bias_scale = scales.get(weight_name), scales.get(bias_name)
            float_mask = mask.to(dtype)
            all_kept = bool(mask.all())
            if all_kept and weight_scale is None:
                norm_masks.append(None)
            else:
                norm_weight = float_mask if weight_scale is None else float_mask / weight_scale.to(dtype) ** 2
                sparse = _csr_if_sparse(norm_weight) if allow_sparse else None
                norm_masks.append(sparse if sparse is not None else norm_weight.T.contiguous())
            bias_weights.append(None if bias_scale is None else (1.0 / bias_scale.to(device=device, dtype=dtype) ** 2))
            bias_terms.append(bias_weights[-1] if bias_weights[-1] is not None
                              else torch.ones(mask.shape[0], dtype=dtype, device=device))
            weight_masks.append(None if all_kept else float_mask)
            sum_masks.append(_csr_if_sparse(float_mask) if allow_sparse else None)
            surviving[weight_name] = None if all_kept else mask.flatten().nonzero().squeeze(1)
            surviving[bias_name] = None
        conv_names, conv_masks = [], []
        for mask_name, _ in model.conv_layers_in_order():
            mask = masks[mask_name].to(device=device, dtype=torch.bool)
            prefix = mask_name.removesuffix(".weight")
            if scales and (scales.get(f"{prefix}.weight") is not None or scales.get(f"{prefix}.bias") is not None):
                raise DpltmUserError("noise geometries (dpd, shaped) apply to the MLP's layers, not to convolutions")
            conv_names.append((f"{prefix}.weight", f"{prefix}.bias"))
            all_kept = bool(mask.all())
            conv_masks.append(None if all_kept else mask.to(dtype))
            surviving[f"{prefix}.weight"] = None if all_kept else mask.flatten().nonzero().squeeze(1)
            surviving[f"{prefix}.bias"] = None
        return cls(norm_masks, weight_masks, surviving, bias_weights, names, sum_masks, conv_names, conv_masks,
                   bias_terms)


SPARSE_BELOW_DENSITY = 0.2
"""Below this density a big layer's norm matmul uses a sparse (CSR) mask: fewer flops than dense
GEMM by more than the sparse kernel's per-flop cost (benchmarks/bench_dp_step.py)."""

SPARSE_FROM_WEIGHTS = 100_000
"""Only layers this big: below it (LeNet-300-100's 300×100 layer) the sparse kernels' fixed costs
(layout copies, single-threaded) exceed a dense GEMM's (measured on 2 CPU threads)."""


def _csr_if_sparse(weights: Tensor) -> Tensor | None:
    """A big layer's (out, in) mask weights as sparse CSR when few survive, else None."""
    if weights.numel() >= SPARSE_FROM_WEIGHTS and float((weights != 0).float().mean()) < SPARSE_BELOW_DENSITY:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            return weights.to_sparse_csr()
    return None


INPUT_TERMS_MAX_BYTES = 1 << 30
"""`first_layer_input_terms` is skipped (the norm is computed per batch) above this size."""


@torch.no_grad()
@ieee_float32()
def first_layer_input_terms(features: Tensor, layout: MaskLayout, rows_at_once: int = 8192) -> Tensor | None:
    """R[i, j] = Σ_k M_jk x_ik² + b_j for every record i: the first layer's share of the masked norm, fixed.

    The first layer's input is the record itself and its mask (scaled by any noise geometry) does
    not change during training, so in ‖(g_i x_iᵀ) ⊙ M‖² + ‖g_i‖²_b = Σ_j g_ij² (M x_i² + b)_j the factor
    M x_i² + b (b: the bias share, `MaskLayout.bias_terms`) is a property of the record: computed once
    per run (one N×in×out product), each step's norm of the widest layer is a row gather and a dot
    product instead of a per-batch product. A dense unscaled first layer needs only ‖x_i‖² + 1 (one
    column). None when the table would exceed `INPUT_TERMS_MAX_BYTES`.
    """
    if layout.conv_parameter_names:  # the first layer is a convolution: its input is not a record row
        return None
    operator, bias_weight = layout.norm_masks[0], layout.bias_weights[0]
    columns = layout.bias_terms[0].numel() if bias_weight is not None else operator_columns(operator)
    if features.shape[0] * columns * features.element_size() > INPUT_TERMS_MAX_BYTES:
        return None
    squares = squares_times(features, operator, rows_at_once)
    if bias_weight is None:
        return squares.add_(1.0)
    # a one-column table (dense unscaled weight) widens to one column per unit; else add in place
    return squares.add_(bias_weight) if squares.shape[1] == bias_weight.numel() else squares + bias_weight


def layer_norm_terms(a: Tensor, operator: Tensor | None, bias_term: Tensor, bias_scaled: bool,
                     add_to: Tensor | None = None) -> Tensor:
    """T[i, j] = Σ_k M_jk a_ik² + b_j for one batch: per output unit, the weight and bias shares of the squared
    norm per unit of g_ij², so the layer's share is Σ_j g_ij² T_ij (the masked ghost norm, Li et al. 2022,
    restricted to the mask; `operator` as in `dpltm.dp.rules.masked_sq_norms`). A dense unscaled layer
    (`operator` None) gives one column ‖a_i‖² + 1 (+ b_j when only the bias is scaled).

    `add_to` (N, out units), holding b_j in every row already (a static step's gathered rows, `bias_term`'s
    values): the weight share is added to it in place, every column: for a mask operator one product accumulated
    where it lies (a strided view: a fresh product would take the bias in cuBLASLt's epilogue only into a
    contiguous result), for a dense unscaled layer its ‖a_i‖² added across the row."""
    if add_to is not None:
        if operator is not None and operator.layout != torch.sparse_csr:
            return add_to.addmm_(a * a, operator)
        return add_to.add_(squares_times(a, operator, rows_at_once=max(a.shape[0], 1)))
    if operator is not None and operator.layout != torch.sparse_csr:
        return torch.addmm(bias_term, a * a, operator)  # the bias added in the product's own kernel
    squares = squares_times(a, operator, rows_at_once=max(a.shape[0], 1))
    return squares.add_(1.0) if operator is None and not bias_scaled else squares + bias_term


def operator_columns(operator: Tensor | None) -> int:
    """Columns of `squares_times`' result: the layer's outputs for a mask operator, 1 for None."""
    if operator is None:
        return 1
    return operator.shape[0] if operator.layout == torch.sparse_csr else operator.shape[1]


@torch.no_grad()
def squares_times(features: Tensor, operator: Tensor | None, rows_at_once: int = 8192) -> Tensor:
    """Per row i of `features` (N, in): (x_i²) W for a mask operator W, dense (in, out) or sparse CSR
    (out, in), or the one column ‖x_i‖² for None: the per-record norm tables of `first_layer_input_terms`
    and `dpltm.dp.engine.record_norm_tables`, in chunks of rows (no N × in square at once)."""
    parts = []
    for start in range(0, features.shape[0], rows_at_once):
        x = features[start : start + rows_at_once]
        if operator is None:
            parts.append(torch.linalg.vector_norm(x, dim=1, keepdim=True).square())
        elif operator.layout == torch.sparse_csr:
            parts.append((operator @ (x * x).T.contiguous()).T)
        else:
            parts.append((x * x) @ operator)
    if not parts:
        return features.new_zeros(0, operator_columns(operator))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()


@dataclass(frozen=True)
class ClippedBatch:
    """Σ_i clip_i(∇ℓ_i) per parameter (masked), the per-sample norms, and the summed loss."""

    grad_sums: dict[str, Tensor]
    """Keyed by parameter name as in `model.named_parameters()`."""
    norms: Tensor
    loss_sum: Tensor | None
    """None where the batch came with one-hot targets (the loss's gradient was written without the loss)."""


@dataclass(frozen=True)
class SumBuffers:
    """Where `clipped_gradient_sum` writes its sums instead of allocating them: a static step's views of one
    flat buffer (dpltm.dp.graphed), so joining the sums for the noise costs no copy."""

    tensors: dict[str, Tensor]
    """Every parameter's sum, by name, shaped like the parameter."""
    fc_biases: Tensor
    """The fully connected layers' bias sums side by side, input to output: their `tensors` are views of it."""


def clip_factors(norms: Tensor, clip: float, row_clips: Tensor | None = None, zero_non_finite: bool = True) -> Tensor:
    """min(1, C/‖g_i‖) (Abadi et al. 2016, Alg. 1 line 6), as C / max(‖g_i‖, C); C = inf disables clipping.

    One correctly rounded division of C by a number ≥ C: never above 1, and nothing overflows (even in float16 a
    large norm gives a small factor, not an infinite quotient and a dropped record). The clipped norm c·‖g‖ can
    still exceed C by the dtype's rounding (about 1e-7 relative in float32, 6e-4 in float16, 8e-3 in bfloat16:
    floating point's share of the sensitivity, which no accountant sees: make_private and DPCallback refuse
    half-precision parameters, dpltm.api_checks.check_full_precision). A record
    whose gradient is not finite gets factor 0 (its contribution is dropped): an inf·0 = NaN would otherwise
    spread through the sum and unbound the sensitivity. No host synchronisation (a CUDA-graph step runs it
    every step): C is a CPU scalar, a kernel argument.

    `row_clips` (one per row: C for a sampled record, 0 for a static-shape batch's padding row, dpltm.dp.padding)
    replace C in the numerator, C_i / max(‖g_i‖, C): a padding row's factor is 0 (its contribution exactly zero)
    and a sampled row's is the same correctly rounded quotient, in the one division (no kernel to weight the
    factors). Only for a finite C. `zero_non_finite=False` leaves a non-finite record's factor NaN (a NaN norm:
    NaN, an infinite one: 0): only for a caller that zeroes every non-finite entry of the clipped rows c_i·g_i
    itself, as the static step does (`clipped_gradient_sum`), so that a dropped record still adds exactly zero.
    """
    if clip == float("inf"):
        if row_clips is not None:
            raise ValueError("row_clips need a finite clipping bound C")
        return torch.isfinite(norms).to(norms.dtype)
    numerator = torch.tensor(clip, dtype=norms.dtype) if row_clips is None else row_clips
    factors = torch.div(numerator, norms.clamp(min=clip))
    return factors.nan_to_num_(nan=0.0) if zero_non_finite else factors


@ieee_float32()
def clipped_gradient_sum(model: LeNet, x: Tensor, y: Tensor, clip: float,
                         layout: MaskLayout, row_clips: Tensor | None = None,
                         input_terms: Tensor | None = None, mask_sums: bool = True,
                         finite_records: bool = False, out: SumBuffers | None = None,
                         joined_terms: Tensor | None = None) -> ClippedBatch:
    """Masked per-sample norms, clipping, and the clipped sum, for one batch (may be empty).

    A dense layer's norm uses ‖g_i a_iᵀ‖ = ‖g_i‖·‖a_i‖ (no matmul at all). `row_clips` (one per row, C or 0)
    make the batch a static-shape one: each row's clipping bound, 0 for a padded batch's padding rows
    (dpltm.dp.padding), so they add exactly zero (`clip_factors`). The step then has no
    data-dependent branch and no host synchronisation (what a CUDA graph needs). `input_terms`
    are the batch's rows of `first_layer_input_terms` (same layout): the first layer's norm is then
    read, not computed. `mask_sums=False` leaves the weight sums unmasked (pruned coordinates hold the clipped
    rows' products there): only for a caller that masks ĝ once at the end (the CUDA-graph step,
    `noisy_mean(..., out=..., out_scales=...)`). `finite_records`: the records (every row of `x`) are known
    finite, checked once per run; a static step then leaves a fully connected first layer's inputs as they are
    (its other layers' inputs and every output gradient are still zeroed where not finite).

    `y` holds class indices, or one-hot rows in the records' dtype (what a static step gathers, beside its
    norm terms, in one row copy). With one-hot rows the output layer's gradient of the summed cross-entropy,
    softmax(z_i) − y_i, is written directly and the loss is not computed (`loss_sum` None): two kernels instead
    of the loss's five, forward and backward. `out`: write the sums into these buffers (`SumBuffers`).
    `joined_terms` (instead of `input_terms`; fully connected networks only): the batch's norm terms of every
    layer side by side, (N, Σ_l out_l), with the first layer's columns holding its rows of
    `first_layer_input_terms` at full width and the other layers' their bias shares b_j (`MaskLayout.bias_terms`;
    a static step gathers them so, `dpltm.dp.graphed.record_rows`): those layers' weight shares are added in
    place, so joining the terms costs no copy. It is written: pass a fresh gather (an `index_select`), never a
    view of a table kept between steps.
    """
    fwd = _forward(model, x, layout)
    one_hot = y.is_floating_point()
    loss_sum = None if one_hot else F.cross_entropy(fwd.logits, y, reduction="sum")
    if x.shape[0] == 0:
        parameters = dict(model.named_parameters())  # in the layout's order, as a non-empty batch gives
        zero = {name: torch.zeros_like(parameters[name]) if out is None else out.tensors[name].zero_()
                for name in layout.all_parameter_names}
        return ClippedBatch(zero, x.new_zeros(0), None if loss_sum is None else loss_sum.detach())
    conv_grads, out_grads = _output_gradients(fwd, y, loss_sum)
    with torch.no_grad():
        parts, conv_weight_per_sample = _conv_norm_parts(fwd, conv_grads)
        joined, joined_terms = _joined_terms(fwd, out_grads, layout, input_terms, joined_terms)
        # Σ_j g_ij² (M a_i² + b)_j per layer: the masked weights' and the bias' shares in one row dot product
        static = row_clips is not None
        if static:  # one batched row dot product: a kernel fewer than the square, product and sum
            parts.append(torch.bmm((joined * joined_terms).unsqueeze(1), joined.unsqueeze(2)).view(-1))
        else:
            parts.append((joined * joined).mul_(joined_terms).sum(dim=1))
        sq_norms = parts[0]
        for part in parts[1:]:
            sq_norms = sq_norms + part
        norms = sq_norms.sqrt()
        convolutional = bool(fwd.conv_constants)
        # 0 for a padding row; 0 for a non-finite record, or NaN in a static step without convolutions, whose clipped
        # rows' NaN are zeroed below (before any sum: the record adds exactly zero)
        factors = clip_factors(norms, clip, row_clips, zero_non_finite=not static or convolutional)
        # eager: ask the device once whether anything is non-finite (rare); static (CUDA graphs): no host
        # synchronisation, so every step zeroes non-finite values (a dropped record's g·0 = NaN; its inputs:
        # 0·inf = NaN in the product), which leaves every finite record's contribution unchanged
        finite = torch.isfinite(norms) if convolutional or not static else None
        all_finite = not static and bool(finite.all())  # type: ignore[union-attr]
        sums = _conv_sums(conv_weight_per_sample, conv_grads, layout, factors, finite, all_finite, out)
        sums.update(_linear_sums(fwd, joined, [g.shape[1] for g in out_grads], layout, factors, finite, all_finite,
                                 static, finite_records, mask_sums, out))
    return ClippedBatch(sums, norms, None if loss_sum is None else loss_sum.detach())


@dataclass
class _Forward:
    """A batch's forward pass with the weights as constants: every layer's input and (grad-requiring) output."""

    conv_constants: list[tuple[torch.nn.Conv2d, Tensor, Tensor, Tensor | None]]
    conv_inputs: list[Tensor]
    conv_outputs: list[Tensor]
    inputs: list[Tensor]
    outputs: list[Tensor]
    logits: Tensor


def _forward(model: LeNet, x: Tensor, layout: MaskLayout) -> _Forward:
    # only ∂ℓ/∂z is needed: the weights enter as constants, so autograd records no weight path (the
    # pruned weights are zero: the ticket's forward pass is the dense one's)
    constants = [(layer.weight.detach(), layer.bias.detach()) for _, layer in model.layers_in_order()]
    conv_constants = [(layer, layer.weight.detach(), layer.bias.detach(), mask)
                      for (_, layer), mask in zip(model.conv_layers_in_order(), layout.conv_masks, strict=True)]
    fwd = _Forward(conv_constants, [], [], [], [], x)
    h = x
    if conv_constants:
        h = model.images(x)
        for _, weight, bias, _ in conv_constants:
            fwd.conv_inputs.append(h)
            z = F.conv2d(h, weight, bias)
            if not z.requires_grad:
                z.requires_grad_(True)
            fwd.conv_outputs.append(z)
            h = model.after_conv(z)
        h = h.flatten(1)
    for index, (weight, bias) in enumerate(constants):
        fwd.inputs.append(h)
        z = F.linear(h, weight, bias)
        if not z.requires_grad:
            z.requires_grad_(True)
        fwd.outputs.append(z)
        h = model.activation(z) if model.is_activation_after(index) else z
    fwd.logits = h
    return fwd


def _output_gradients(fwd: _Forward, y: Tensor,
                      loss_sum: Tensor | None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """∂(Σ_i ℓ_i)/∂z for every layer's output z: the convolutions' and the linear layers'. With one-hot `y` (no
    `loss_sum`) the output layer's, ∂(Σ_i CE(z_i, y_i))/∂z_i = softmax(z_i) − y_i, is written directly (no
    activation follows the output layer)."""
    h = fwd.logits
    if loss_sum is None:
        last = torch.softmax(h.detach(), dim=1).sub_(y)
        earlier = fwd.conv_outputs + fwd.outputs[:-1]
        all_grads = (*torch.autograd.grad(h, earlier, grad_outputs=last), last) if earlier else (last,)
    else:
        all_grads = torch.autograd.grad(loss_sum, fwd.conv_outputs + fwd.outputs)
    return all_grads[: len(fwd.conv_outputs)], all_grads[len(fwd.conv_outputs):]


def _conv_norm_parts(fwd: _Forward, conv_grads: tuple[Tensor, ...]) -> tuple[list[Tensor], list[Tensor]]:
    """Each convolution's share of the squared norms (its surviving weights' and its bias'), and its masked
    per-sample weight gradients."""
    parts: list[Tensor] = []  # each layer's share of the squared norms, summed by the caller
    conv_weight_per_sample = []
    for (layer, _, _, mask), a, g in zip(fwd.conv_constants, fwd.conv_inputs, conv_grads, strict=True):
        per_sample = conv2d_weight_grads(layer, a, g)
        if mask is not None:
            per_sample = per_sample * mask  # the surviving weights' share only
        conv_weight_per_sample.append(per_sample)
        parts.append(per_sample.flatten(1).pow(2).sum(dim=1) + g.sum(dim=(2, 3)).pow(2).sum(dim=1))
    return parts, conv_weight_per_sample


def _joined_terms(fwd: _Forward, out_grads: tuple[Tensor, ...], layout: MaskLayout, input_terms: Tensor | None,
                  joined_terms: Tensor | None) -> tuple[Tensor, Tensor]:
    """The fully connected layers side by side: their output gradients G = [g_1 … g_L] and norm terms
    T = [T_1 … T_L] in one row each (one copy apiece), so their squared norms Σ_j G_ij² T_ij, the clipping
    of G and the bias sums take one kernel each, whatever the depth."""
    widths = [g.shape[1] for g in out_grads]
    offsets = [0, *itertools.accumulate(widths)]
    joined = torch.cat(out_grads, dim=1) if len(out_grads) > 1 else out_grads[0]
    layers = list(zip(fwd.inputs, layout.norm_masks, layout.bias_weights, layout.bias_terms, strict=True))
    if joined_terms is not None:  # the first layer's columns gathered already; the others' weight shares added
        if input_terms is not None or fwd.conv_constants or joined_terms.shape != joined.shape:
            raise ValueError(f"joined_terms (without input_terms) must be {tuple(joined.shape)} for a fully "
                             "connected network")
        for index, (a, operator, bias_weight, bias_term) in enumerate(layers[1:], start=1):
            layer_norm_terms(a, operator, bias_term, bias_weight is not None,
                             add_to=joined_terms[:, offsets[index]: offsets[index + 1]])
    else:
        terms = [input_terms if index == 0 and input_terms is not None
                 else layer_norm_terms(a, operator, bias_term, bias_weight is not None)
                 for index, (a, operator, bias_weight, bias_term) in enumerate(layers)]
        joined_terms = torch.cat([t.expand_as(g) for t, g in zip(terms, out_grads, strict=True)], dim=1)
    return joined, joined_terms


def _conv_sums(conv_weight_per_sample: list[Tensor], conv_grads: tuple[Tensor, ...], layout: MaskLayout,
               factors: Tensor, finite: Tensor | None, all_finite: bool, out: SumBuffers | None) -> dict[str, Tensor]:
    """The convolutions' clipped sums (weights and biases); a non-finite record adds exactly zero."""
    sums: dict[str, Tensor] = {}
    for per_sample, g, (weight_name, bias_name) in zip(conv_weight_per_sample, conv_grads,
                                                       layout.conv_parameter_names, strict=True):
        keep = factors  # already 0 for a non-finite record
        per_sample = per_sample if all_finite else torch.where(
            finite.view(-1, 1, 1, 1, 1), per_sample, torch.zeros_like(per_sample))  # type: ignore[union-attr]
        bias_rows = g.sum(dim=(2, 3))
        bias_rows = bias_rows if all_finite else torch.where(finite[:, None], bias_rows,  # type: ignore[index]
                                                             torch.zeros_like(bias_rows))
        weight_sum, bias_sum = torch.einsum("b,b...->...", keep, per_sample), (bias_rows * keep[:, None]).sum(dim=0)
        sums[weight_name] = weight_sum if out is None else out.tensors[weight_name].copy_(weight_sum)
        sums[bias_name] = bias_sum if out is None else out.tensors[bias_name].copy_(bias_sum)
    return sums


def _linear_sums(fwd: _Forward, joined: Tensor, widths: list[int], layout: MaskLayout, factors: Tensor,
                 finite: Tensor | None, all_finite: bool, static: bool, finite_records: bool, mask_sums: bool,
                 out: SumBuffers | None) -> dict[str, Tensor]:
    """The fully connected layers' clipped sums (c ⊙ G)ᵀ A and bias sums, the pruned coordinates left out."""
    offsets = [0, *itertools.accumulate(widths)]
    convolutional = bool(fwd.conv_constants)
    sums: dict[str, Tensor] = {}
    scaled_all = joined * factors[:, None]
    if static:
        scaled_all = scaled_all.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    elif not all_finite:  # rare: zero the dropped records' rows
        scaled_all = torch.where(finite[:, None], scaled_all, torch.zeros_like(scaled_all))  # type: ignore[index]
    all_bias_sums = scaled_all.sum(dim=0) if out is None else torch.sum(scaled_all, dim=0, out=out.fc_biases)
    bias_sums = all_bias_sums.split(widths)
    for index, (a, (weight_name, bias_name), pruned, sum_mask) in enumerate(zip(
            fwd.inputs, layout.parameter_names, layout.pruned_masks, layout.sum_masks, strict=True)):
        scaled = scaled_all[:, offsets[index]: offsets[index + 1]]
        if static:  # a dropped record's inputs too: 0·inf = NaN in the product
            if not (index == 0 and finite_records and not convolutional):  # a record row: finite already
                a = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        elif not all_finite:
            a = torch.where(finite[:, None], a, torch.zeros_like(a))  # type: ignore[index]
        if sum_mask is not None:  # only the surviving entries of (c ⊙ G)ᵀ A, then scattered
            kept = torch.sparse.sampled_addmm(sum_mask, scaled.T.contiguous(), a, beta=0.0).values()
            weight_sum = a.new_zeros(sum_mask.shape) if out is None else out.tensors[weight_name].zero_()
            weight_sum.view(-1).index_copy_(0, layout.surviving[weight_name], kept)  # type: ignore[arg-type]
        else:
            weight_sum = scaled.T @ a if out is None else torch.mm(scaled.T, a, out=out.tensors[weight_name])
            if pruned is not None and mask_sums:  # set, not multiplied: a pruned entry is not bounded
                weight_sum.masked_fill_(pruned, 0.0)  # by the clipping, and inf·0 would be NaN
        sums[weight_name] = weight_sum
        sums[bias_name] = bias_sums[index]
    return sums
