"""Masked per-sample clipping for a user's own `nn.Module`: every `nn.Linear` and `nn.Conv2d`, wherever
it sits.

The built-in MLP has its own fused step (dpltm.dp.ghost); this module serves any model built from
supported layers. A forward pass with hooks records each trainable layer's input a_i and output
z_i; one autograd call on Σ_i ℓ_i gives g_i = ∂ℓ_i/∂z_i for every sample (samples do not interact:
layers that mix them, like BatchNorm, are refused). Per layer and sample, with M the weight's mask:

* `nn.Linear` on (B, in) inputs: ‖(g_i a_iᵀ) ⊙ M‖² = (g_i²)ᵀ M (a_i²) — the masked ghost norm
  (PRIVACY.md §3; the same `_masked_sq_norms` as the MLP); the clipped sum is (c ⊙ G)ᵀ A ⊙ M.
* `nn.Linear` on (B, …, in) inputs (sequences): the per-sample gradient Σ_t g_it a_itᵀ is formed
  explicitly (no ghost identity survives the sum over t), masked, squared and summed.
* `nn.Conv2d`: the input is unfolded into patches U_i (C·kh·kw × L positions); the per-sample
  weight gradient is G_i U_iᵀ (out × C·kh·kw), masked, squared and summed; the bias gets Σ_l g_il.

Biases are never masked. A layer with trainable parameters of any other kind is a one-line error
naming it: never silently wrong norms. tests/test_per_sample.py compares every supported layer
with torch.func per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.ghost import ClippedBatch, _masked_sq_norms, clip_factors, conv_weight_grads
from dpltm.errors import DpltmUserError

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)
Loss = Callable[[Tensor, Tensor], Tensor]
"""(outputs, targets) -> per-sample losses, shape (B,)."""


def per_sample_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


def trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer with trainable parameters, checked to be supported.

    Refused, in one line naming the layer: trainable parameters in any other kind of layer; batch
    normalisation in training mode (even frozen: its batch statistics make one sample's gradient
    depend on the others, and its running statistics are released without noise); a weight shared
    by two layers (its gradient would be counted once in the sum but twice in the norm).
    """
    layers = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        label = name or type(module).__name__
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) mixes the samples of a batch, which "
                                 "per-sample clipping cannot bound: remove it, or put it in eval mode and freeze it")
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
        if not isinstance(module, SUPPORTED_LAYERS):
            raise DpltmUserError(
                f"layer {label} ({type(module).__name__}) has trainable parameters dpltm cannot clip per sample: "
                "supported are nn.Linear and nn.Conv2d (freeze it with requires_grad_(False), or replace it)")
        if {n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has parameters besides weight and bias")
        if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                              or isinstance(module.padding, str) and module.padding != "valid"):
            raise DpltmUserError(f"layer {label} (Conv2d): dpltm supports groups=1 and numeric zero padding")
        layers.append((name, module))
    if not layers:
        raise DpltmUserError("the model has no trainable nn.Linear or nn.Conv2d layer")
    return layers


@dataclass
class _Tap:
    name: str
    module: nn.Module
    input: Tensor | None = None
    output: Tensor | None = None


@contextmanager
def _recording(layers: list[tuple[str, nn.Module]]) -> Iterator[list[_Tap]]:
    taps = [_Tap(name, module) for name, module in layers]
    handles = []
    for tap in taps:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor, tap: _Tap = tap) -> Tensor:
            if tap.output is not None:
                raise DpltmUserError(f"layer {tap.name} runs twice in one forward pass: weight sharing is not "
                                     "supported by dpltm's per-sample clipping")
            tap.input, tap.output = inputs[0].detach(), output
            return output.clone()  # later in-place ops (ReLU(inplace=True)) act on the copy, not on z
        handles.append(tap.module.register_forward_hook(hook))
    try:
        yield taps
    finally:
        for handle in handles:
            handle.remove()


def _per_sample_weight_grads(tap: _Tap, g: Tensor) -> Tensor | None:
    """(B, *weight.shape) per-sample weight gradients, or None for a 2-D Linear (ghost path)."""
    module, a = tap.module, tap.input
    assert a is not None
    if isinstance(module, nn.Conv2d):
        return conv_weight_grads(module, a, g)
    if a.dim() > 2:
        return torch.einsum("bto,bti->boi", g.reshape(g.shape[0], -1, g.shape[-1]),
                            a.reshape(a.shape[0], -1, a.shape[-1]))
    return None


def _per_sample_bias_grads(tap: _Tap, g: Tensor) -> Tensor:
    if isinstance(tap.module, nn.Conv2d):
        return g.flatten(2).sum(dim=2)
    return g.reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1)


def clipped_gradient_sum_of(model: nn.Module, x: Tensor, y: Tensor, clip: float,
                            masks: dict[str, Tensor] | None = None, loss: Loss = per_sample_cross_entropy,
                            weights: Tensor | None = None) -> ClippedBatch:
    """Per-sample norms over the surviving weights, clipping, and the masked clipped sum, for any
    model of supported layers. `masks` maps weight names (as in `model.named_parameters()`) to
    0/1 tensors; unmasked weights are dense. `weights` (0/1 per row) as in dpltm.dp.ghost."""
    layers = trainable_layers(model)
    masks = masks or {}
    parameters = dict(model.named_parameters())
    if x.shape[0] == 0:  # an empty Poisson batch: a zero sum (the step still adds noise)
        return ClippedBatch({n: torch.zeros_like(p) for n, p in parameters.items() if p.requires_grad},
                            x.new_zeros(0), x.new_zeros(()))
    with _recording(layers) as taps:
        outputs = model(x)
    losses = loss(outputs, y)
    if losses.shape != (x.shape[0],):
        raise DpltmUserError(f"the loss must give one value per sample, shape ({x.shape[0]},); "
                             f"got {tuple(losses.shape)}")
    loss_sum = losses.sum()
    for tap in taps:
        if tap.output is None:
            raise DpltmUserError(f"layer {tap.name} has trainable parameters but took no part in the forward pass")
    out_grads = torch.autograd.grad(loss_sum, [tap.output for tap in taps], allow_unused=True)  # type: ignore[misc]
    unused = [tap.name for tap, g in zip(taps, out_grads) if g is None]
    if unused:
        raise DpltmUserError(f"the loss does not depend on layer(s) {unused}: every trainable layer must take part")
    sums, norms = clip_and_sum(taps, list(out_grads), masks, clip, weights, batch_size=x.shape[0])
    order = [name for name, p in parameters.items() if p.requires_grad]
    return ClippedBatch({name: sums[name] for name in order}, norms, loss_sum.detach())


@torch.no_grad()
def clip_and_sum(taps: list[_Tap], out_grads: list[Tensor], masks: dict[str, Tensor], clip: float,
                 weights: Tensor | None = None, batch_size: int | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Per-sample norms over the surviving weights, clip factors, and the masked clipped sums, from
    each layer's recorded input and per-sample output gradient (keyed by parameter name)."""
    x = taps[0].input
    assert x is not None
    batch = out_grads[0].shape[0] if batch_size is None else batch_size
    for tap, g in zip(taps, out_grads):  # dimension 0 must be the sample everywhere
        if tap.input is None or tap.input.shape[0] != batch or g.shape[0] != batch:
            raise DpltmUserError(f"layer {tap.name} does not see one row per sample in dimension 0 (batch {batch}): "
                                 "dpltm's per-sample clipping needs batch-first layers, without reshaping samples "
                                 "into rows")
    sq_norms = x.new_zeros(batch, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    per_sample: list[tuple[Tensor | None, Tensor]] = []
    for tap, g in zip(taps, out_grads):
        prefix = f"{tap.name}." if tap.name else ""
        module, a = tap.module, tap.input
        assert a is not None
        mask = masks.get(f"{prefix}weight")
        mask = None if mask is None else mask.to(device=g.device, dtype=g.dtype)
        weight_grads = _per_sample_weight_grads(tap, g)
        if module.weight.requires_grad:
            if weight_grads is not None:
                masked = weight_grads if mask is None else weight_grads * mask
                sq_norms += masked.flatten(1).pow(2).sum(dim=1)
            elif mask is None:
                sq_norms += (g * g).sum(dim=1) * (a * a).sum(dim=1)
            else:
                sq_norms += _masked_sq_norms(a, g * g, mask.T.contiguous())
        bias_grads = None
        if getattr(module, "bias", None) is not None and module.bias.requires_grad:  # type: ignore[union-attr]
            bias_grads = _per_sample_bias_grads(tap, g)
            sq_norms += bias_grads.pow(2).sum(dim=1)
        per_sample.append((weight_grads, bias_grads if bias_grads is not None else g))
    norms = sq_norms.sqrt()
    finite = torch.isfinite(norms)
    factors = clip_factors(norms, clip)
    if weights is not None:
        factors = factors * weights
    # factors stay float32 or wider: rounding them to bf16 could push a clipped norm past C
    factors = factors.to(torch.promote_types(x.dtype, torch.float32))
    sums: dict[str, Tensor] = {}
    for tap, g, (weight_grads, bias_grads) in zip(taps, out_grads, per_sample):
        prefix = f"{tap.name}." if tap.name else ""
        module, a = tap.module, tap.input
        assert a is not None
        keep = finite.view(-1, *[1] * (g.dim() - 1))
        g = torch.where(keep, g, torch.zeros_like(g))
        if module.weight.requires_grad:
            mask = masks.get(f"{prefix}weight")
            if weight_grads is not None:
                weight_grads = torch.where(finite.view(-1, *[1] * (weight_grads.dim() - 1)), weight_grads,
                                           torch.zeros_like(weight_grads))
                total = torch.einsum("b,b...->...", factors, weight_grads)
            else:
                a = torch.where(finite[:, None], a, torch.zeros_like(a))
                total = (g * factors[:, None]).T @ a
            if mask is not None:
                total = total * mask.to(device=total.device, dtype=total.dtype)
            sums[f"{prefix}weight"] = total
        if getattr(module, "bias", None) is not None and module.bias.requires_grad:  # type: ignore[union-attr]
            bias = torch.where(finite[:, None], bias_grads, torch.zeros_like(bias_grads))
            sums[f"{prefix}bias"] = (bias * factors[:, None]).sum(dim=0)
    return sums, norms
