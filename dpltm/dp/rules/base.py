"""The registry's machinery: what a forward hook records for a layer (`LayerCall`), the protocol a layer
type's rule follows (`LayerRule`), `register_rule` / `rule_for`, the shared base of rules that form each
sample's gradient (`MaterialisedRule`, `WeightAndBiasRule`), and the torch.func rule every layer type
without its own rule falls back to, with the check that such a layer does not mix samples."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dpltm.errors import DpltmUserError

LocalMasks = dict[str, Tensor]
"""A layer's own parameter name (``weight``) → 0/1 mask of its shape, float, on the layer's device."""


@dataclass
class LayerCall:
    """What one forward pass recorded for one layer: its positional inputs and keyword arguments, and
    its output (kept in the autograd graph so that g = ∂Σℓ/∂z can be asked for)."""

    name: str
    module: nn.Module
    inputs: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: Tensor | None = None
    batch_grads: dict[str, Tensor] | None = None
    """The layer's batch gradients Σ_i ∇_θ ℓ_i by local name, where a backward pass already formed them
    (a Lightning step); else they are asked of `output`'s graph when a check needs them."""
    input_terms: Tensor | None = None
    """This batch's rows of the layer's `record_norm_tables` (dpltm.dp.engine), set only when the layer
    was fed the records themselves: its masked norm is then Σ_j g_ij² R_ij, no product with the batch."""
    hold_for_sum: bool = True
    """Whether a rule may keep tensors of the batch's size (patches, per-token gradients) from its norms to its
    sum; False where the sum comes on a second backward pass, whose point is to hold none (dpltm.dp.engine)."""
    totals: dict[str, Tensor] | None = None
    """A chunk of a batch (dpltm.dp.engine.clip_and_sum_in_chunks): its per-sample gradients' sums are added
    here, and the batch's total is checked against `batch_grads` once every chunk has run."""

    @property
    def input(self) -> Tensor | None:
        """The first input: the tensor whose dimension 0 must be the sample."""
        if not self.inputs:
            return None
        first = self.inputs[0]
        return first if isinstance(first, Tensor) else None

    def record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
               keep_output: bool = True) -> None:
        """What a forward hook saw: the inputs (detached), keyword arguments and, to ask the graph for
        g = ∂Σℓ/∂z later, the output. A layer must return one tensor."""
        if not isinstance(output, Tensor):
            raise DpltmUserError(f"layer {self.name} ({type(module).__name__}) returns a {type(output).__name__}, "
                                 "not one tensor: not supported by dpltm's per-sample clipping")
        self.inputs = tuple(v.detach() if isinstance(v, Tensor) else v for v in args)
        self.kwargs, self.output = dict(kwargs), output if keep_output else None

    def trainable(self) -> dict[str, nn.Parameter]:
        """The layer's own parameters that training updates, by local name."""
        return {n: p for n, p in self.module.named_parameters(recurse=False) if p.requires_grad}


class LayerRule(Protocol):
    """How one layer type gives masked per-sample squared norms and clipped sums."""

    def check(self, label: str, module: nn.Module) -> None:
        """Refuse, in one line naming the layer, a configuration the rule cannot handle exactly."""

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        """(B,) squared norms of the per-sample gradients over surviving coordinates, and any state
        (per-sample gradients already formed) that `clipped_sums` may reuse."""

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None, masks: LocalMasks,
                     state: Any) -> dict[str, Tensor]:
        """Σ_i factors_i ∇_θ ℓ_i ⊙ M per local parameter name. Rows with `finite` False have factor 0
        and must add exactly zero (their gradients may hold inf or NaN); `finite` None: all are finite."""


RULES: dict[type[nn.Module], LayerRule] = {}


def register_rule(*layer_types: type[nn.Module]) -> Callable[[type], type]:
    """Class decorator: the rule serves these layer types and their subclasses."""
    def decorate(rule_class: type) -> type:
        for layer_type in layer_types:
            RULES[layer_type] = rule_class()
        return rule_class
    return decorate


def rule_for(module: nn.Module) -> LayerRule:
    """The most specific registered rule for the module's type, else the torch.func rule."""
    for klass in type(module).__mro__:
        if klass in RULES:
            return RULES[klass]
    return FUNC_RULE


def zero_rows(values: Tensor, finite: Tensor | None) -> Tensor:
    """`values` with the rows of non-finite records set to exactly zero (0·inf would be NaN); `finite`
    None: every record is finite (the engine asks the device once per step, not once per layer)."""
    if finite is None:
        return values
    return torch.where(finite.view(-1, *[1] * (values.dim() - 1)), values, torch.zeros_like(values))


def masked_sq_norms(a: Tensor, g2: Tensor, operator: Tensor) -> Tensor:
    """Σ_jk g_ij² W_jk a_ik² per row i, with W the (scaled) 0/1 mask: the masked ghost norm.

    `operator` is W as sparse CSR (out, in) or dense Wᵀ (in, out)."""
    if operator.layout == torch.sparse_csr:
        # square straight into the (in, batch) layout the sparse product wants: one pass
        a2t = torch.mul(a.T, a.T, out=torch.empty(a.shape[1], a.shape[0], dtype=a.dtype, device=a.device))
        return (operator @ a2t).T.mul_(g2).sum(dim=1)
    return ((a * a) @ operator).mul_(g2).sum(dim=1)


class MaterialisedRule:
    """A rule that forms each sample's gradient explicitly, then masks, squares and sums it."""

    def check(self, label: str, module: nn.Module) -> None:
        return None

    def per_sample_grads(self, call: LayerCall, g: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        grads = self.per_sample_grads(call, g)
        grads = {n: (v * masks[n] if n in masks else v) for n, v in grads.items()}
        total = sum(v.reshape(v.shape[0], -1).pow(2).sum(dim=1) for v in grads.values())  # a 0-dim parameter too
        return total, grads  # type: ignore[return-value]

    def clipped_sums(self, call: LayerCall, g: Tensor, factors: Tensor, finite: Tensor | None,
                     masks: LocalMasks, state: Any) -> dict[str, Tensor]:
        return {n: torch.einsum("b,b...->...", factors, zero_rows(v, finite).to(factors.dtype)).to(v.dtype)
                for n, v in state.items()}


class WeightAndBiasRule(MaterialisedRule):
    """A layer with a weight and perhaps a bias only: `weight_grads` and `bias_grads` where each is trained."""

    def check(self, label: str, module: nn.Module) -> None:
        if {n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}:
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has parameters besides weight and bias")

    weight_grads: Callable[[Any, Tensor, Tensor], Tensor]
    """(module, input a, output gradient g) -> (B, *weight.shape) per-sample gradients."""
    bias_grads: Callable[[Any, Tensor], Tensor]
    """(module, output gradient g) -> (B, *bias.shape) per-sample gradients."""

    def per_sample_grads(self, call: LayerCall, g: Tensor) -> dict[str, Tensor]:
        module = call.module
        assert call.input is not None
        grads = {}
        if module.weight.requires_grad:
            grads["weight"] = self.weight_grads(module, call.input, g)
        bias = getattr(module, "bias", None)  # RMSNorm has none
        if bias is not None and bias.requires_grad:
            grads["bias"] = self.bias_grads(module, g)
        return grads


KNOWN_PER_SAMPLE: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d,
    nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Embedding, nn.PReLU, nn.Bilinear,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
"""Layer types whose output for one sample reads only that sample's input: the torch.func rule is
exact for them without a check. (Instance normalisation keeping running statistics is refused in
training mode by dpltm.dp.engine.trainable_layers; in eval mode it reads fixed statistics.)"""


class FuncRule(MaterialisedRule):
    """Any other layer: per-sample gradients by torch.func (vmap of a vector-Jacobian product)."""

    def check(self, label: str, module: nn.Module) -> None:
        if bool(getattr(module, "sparse", False)):
            raise DpltmUserError(f"layer {label} ({type(module).__name__}) has sparse gradients: not supported by "
                                 "dpltm's per-sample clipping (use sparse=False)")

    def per_sample_grads(self, call: LayerCall, g: Tensor) -> dict[str, Tensor]:
        from torch.func import functional_call, grad, vmap

        module, inputs = call.module, call.inputs or ()
        rows = g.shape[0]
        batched = [i for i, value in enumerate(inputs) if isinstance(value, Tensor) and value.dim() > 0
                   and value.shape[0] == rows]
        if any(isinstance(v, Tensor) for v in call.kwargs.values()):
            raise DpltmUserError(f"layer {call.name} ({type(module).__name__}) takes tensor keyword arguments: "
                                 "dpltm's per-sample clipping supports them only as positional inputs")
        params = {n: p.detach() for n, p in call.trainable().items()}

        def inner_product(p: dict[str, Tensor], rows_in: list[Tensor], g_i: Tensor) -> Tensor:
            full = list(inputs)
            for position, value in zip(batched, rows_in):
                full[position] = value.unsqueeze(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = functional_call(module, p, tuple(full), call.kwargs)
            return (out * g_i.unsqueeze(0)).sum()

        detached = [inputs[i].detach() for i in batched]
        try:
            return vmap(grad(inner_product), in_dims=(None, 0, 0))(params, detached, g.detach())
        except RuntimeError as error:  # e.g. randomness inside the layer, or an op torch.func cannot batch
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DpltmUserError(f"layer {call.name} ({type(module).__name__}): torch.func cannot form its "
                                 f"per-sample gradients ({first[:200]})") from None

    @staticmethod
    def checks(module: nn.Module) -> bool:
        """Whether the layer's per-sample gradients are checked against its batch gradient (its type is
        not known to be per-sample)."""
        return not isinstance(module, KNOWN_PER_SAMPLE)

    def sq_norms(self, call: LayerCall, g: Tensor, masks: LocalMasks) -> tuple[Tensor, Any]:
        total, grads = super().sq_norms(call, g, masks)
        if self.checks(call.module):
            sums = {name: per_sample.sum(dim=0) for name, per_sample in grads.items()}
            if call.totals is None:
                check_adds_up(call, g, sums, masks)
            else:  # a chunk: the whole batch's total is checked when its chunks are done
                for name, part in sums.items():
                    call.totals[name] = call.totals[name] + part if name in call.totals else part
        return total, grads


FUNC_RULE = FuncRule()


def check_adds_up(call: LayerCall, g: Tensor | None, sums: dict[str, Tensor], masks: LocalMasks) -> None:
    """The per-sample gradients of a layer not known to be per-sample must add up to its batch gradient;
    if they do not, the layer's output for one sample depends on other samples, and clipping each
    sample's gradient bounds nothing (docs/privacy.md §3). Refused in one line naming the layer. `sums`: the
    per-sample gradients' sums by local name; `g` (the output gradient) is needed only without `batch_grads`."""
    parameters = call.trainable()
    if call.batch_grads is not None:
        batch: tuple[Tensor | None, ...] = tuple(call.batch_grads.get(n) for n in parameters)
    else:
        assert call.output is not None and g is not None
        with torch.enable_grad():
            batch = torch.autograd.grad(call.output, list(parameters.values()), g, retain_graph=True,
                                        allow_unused=True)
    for (name, _), total in zip(parameters.items(), batch):
        mine = sums[name]
        expected = torch.zeros_like(mine) if total is None else (total * masks[name] if name in masks else total)
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        if not torch.allclose(mine, expected, rtol=1e-3, atol=1e-5 * max(scale, 1e-12)):
            raise DpltmUserError(f"layer {call.name} ({type(call.module).__name__}): its per-sample gradients do not "
                                 "add up to the batch gradient, so its output for one sample depends on other "
                                 "samples, which per-sample clipping cannot bound")
