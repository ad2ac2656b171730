"""The DP engine's per-sample core: masked per-sample norms, clipping and the clipped sum, for any
`nn.Module` — the API's `make_private`, the Lightning `DPCallback` and the audit use it.

A forward pass with hooks records every layer that owns trainable parameters (its inputs and its
output z); one autograd call on Σ_i ℓ_i gives g_i = ∂ℓ_i/∂z_i for every sample, because z_i influences
only ℓ_i. Each layer's rule (dpltm.dp.rules: the registry — exact ghost norms for nn.Linear,
unfolded patches for nn.Conv2d, torch.func for any other layer) turns (a_i, g_i, mask) into the
per-sample squared norms over the surviving weights and, given the clip factors
c_i = min(1, C/‖∇ℓ_i ⊙ M‖), the clipped sum Σ_i c_i ∇ℓ_i ⊙ M (Abadi et al. 2016, Alg. 1;
docs/privacy.md §3).

Refused, in one line naming the layer: batch normalisation in training mode and running statistics
(they mix the samples of a batch, or release statistics of the private data without noise), a weight
shared by two layers, a layer run twice in one forward pass, and a layer whose output rows are not
the samples. Biases are never masked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.ghost import ClippedBatch, clip_factors
from dpltm.dp.rules import FuncRule, LayerCall, rule_for
from dpltm.errors import DpltmUserError
from dpltm.model import prunable_weights

Loss = Callable[[Tensor, Tensor], Tensor]
"""(outputs, targets) -> per-sample losses, shape (B,)."""


def per_sample_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


def trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer that owns trainable parameters, each checked by its rule.

    Refused, in one line naming the layer: batch normalisation in training mode (even frozen: its
    batch statistics make one sample's gradient depend on the others) and any layer keeping running
    statistics in training mode (they would be released without noise); a weight shared by two
    layers (its gradient would be counted once in the sum but twice in the norm).
    """
    layers = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        label = name or type(module).__name__
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) mixes the samples of a batch, which "
                                 "per-sample clipping cannot bound: remove it, or put it in eval mode and freeze it")
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
    """The weights a ticket may mask (`dpltm.model.prunable_weights`: one rule for every network), once
    every layer is checked to be one the engine can clip (`trainable_layers`, one-line refusals)."""
    trainable_layers(model)
    return list(prunable_weights(model))


@contextmanager
def _recording(layers: list[tuple[str, nn.Module]]) -> Iterator[list[LayerCall]]:
    calls = [LayerCall(name, module) for name, module in layers]
    handles = []
    for call in calls:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 call: LayerCall = call) -> Tensor:
            if call.output is not None:
                raise DpltmUserError(f"layer {call.name} runs twice in one forward pass: weight sharing is not "
                                     "supported by dpltm's per-sample clipping")
            call.record(module, args, kwargs, output)
            return output.clone()  # later in-place ops (ReLU(inplace=True)) act on the copy, not on z
        handles.append(call.module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _needs_graph(calls: list[LayerCall]) -> bool:
    """Whether a layer's rule will ask its output's graph for a batch gradient (the mixing check)."""
    return any(isinstance(rule_for(c.module), FuncRule) and FuncRule.checks(c.module) for c in calls)


def clipped_gradient_sum_of(model: nn.Module, x: Tensor, y: Tensor, clip: float,
                            masks: dict[str, Tensor] | None = None, loss: Loss = per_sample_cross_entropy,
                            weights: Tensor | None = None) -> ClippedBatch:
    """Per-sample norms over the surviving weights, clipping, and the masked clipped sum, for any
    model. `masks` maps weight names (as in `model.named_parameters()`) to 0/1 tensors; unmasked
    weights are dense. `weights` (0/1 per row) multiply the clip factors (padding rows add zero)."""
    layers = trainable_layers(model)
    masks = masks or {}
    parameters = dict(model.named_parameters())
    if x.shape[0] == 0:  # an empty Poisson batch: a zero sum (the step still adds noise)
        return ClippedBatch({n: torch.zeros_like(p) for n, p in parameters.items() if p.requires_grad},
                            x.new_zeros(0), x.new_zeros(()))
    with _recording(layers) as calls:
        outputs = model(x)
    losses = loss(outputs, y)
    if losses.shape != (x.shape[0],):
        raise DpltmUserError(f"the loss must give one value per sample, shape ({x.shape[0]},); "
                             f"got {tuple(losses.shape)}")
    loss_sum = losses.sum()
    for call in calls:
        if call.output is None:
            raise DpltmUserError(f"layer {call.name} has trainable parameters but took no part in the forward pass")
    out_grads = torch.autograd.grad(loss_sum, [call.output for call in calls], allow_unused=True,  # type: ignore[misc]
                                    retain_graph=_needs_graph(calls))
    unused = [call.name for call, g in zip(calls, out_grads) if g is None]
    if unused:
        raise DpltmUserError(f"the loss does not depend on layer(s) {unused}: every trainable layer must take part")
    sums, norms = clip_and_sum(calls, list(out_grads), masks, clip, weights, batch_size=x.shape[0])
    order = [name for name, p in parameters.items() if p.requires_grad]
    return ClippedBatch({name: sums[name] for name in order}, norms, loss_sum.detach())


@torch.no_grad()
def clip_and_sum(calls: list[LayerCall], out_grads: list[Tensor], masks: dict[str, Tensor], clip: float,
                 weights: Tensor | None = None, batch_size: int | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Per-sample norms over the surviving weights, clip factors, and the masked clipped sums, from
    each layer's recorded inputs and per-sample output gradient (keyed by parameter name)."""
    batch = out_grads[0].shape[0] if batch_size is None else batch_size
    for call, g in zip(calls, out_grads):  # dimension 0 must be the sample everywhere
        if call.input is None or call.input.shape[0] != batch or g.shape[0] != batch:
            raise DpltmUserError(f"layer {call.name} does not see one row per sample in dimension 0 (batch {batch}): "
                                 "dpltm's per-sample clipping needs batch-first layers, without reshaping samples "
                                 "into rows")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in out_grads) else torch.float32
    sq_norms = out_grads[0].new_zeros(batch, dtype=dtype)
    states = []
    for call, g in zip(calls, out_grads):
        rule, local = rule_for(call.module), _local_masks(call, masks, g)
        norms_here, state = rule.sq_norms(call, g, local)
        sq_norms += norms_here.to(dtype)
        states.append((rule, local, state))
    norms = sq_norms.sqrt()
    finite: Tensor | None = torch.isfinite(norms)
    if bool(finite.all()):  # the one host synchronisation: the rules then skip zeroing rows
        finite = None
    factors = clip_factors(norms, clip)
    if weights is not None:
        factors = factors * weights
    # factors stay float32 or wider: rounding them to bf16 could push a clipped norm past C
    factors = factors.to(dtype)
    sums: dict[str, Tensor] = {}
    for call, g, (rule, local, state) in zip(calls, out_grads, states):
        prefix = f"{call.name}." if call.name else ""
        for local_name, total in rule.clipped_sums(call, g, factors, finite, local, state).items():
            sums[prefix + local_name] = total
    return sums, norms


def _local_masks(call: LayerCall, masks: dict[str, Tensor], like: Tensor) -> dict[str, Tensor]:
    """The layer's masks by local parameter name, as float tensors on its gradient's device."""
    prefix = f"{call.name}." if call.name else ""
    local = {}
    for local_name, parameter in call.module.named_parameters(recurse=False):
        mask = masks.get(prefix + local_name)
        if mask is not None and parameter.requires_grad:
            local[local_name] = mask.to(device=like.device, dtype=parameter.dtype)
    return local
