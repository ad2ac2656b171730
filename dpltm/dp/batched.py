"""K masked networks of one architecture trained side by side by DP-SGD, in one set of kernels.

Used to compare tickets under the noise a planned private run will see (dpltm.selection.noise_aware):
every candidate gets the same Poisson batches (common random numbers, so differences between
candidates are not sampling luck) and its own independent noise. Parameters are stacked along
a leading candidate axis, (K, out, in) and (K, out), so a forward pass is one batched matmul
per layer; the per-sample masked norms use the ghost identity of dpltm.dp.ghost,

    ‖(g_i a_iᵀ) ⊙ M‖² = Σ_jk g_ij² M_jk a_ik²,

batched over candidates. The first layer's input is the same records for every candidate, so its forward
pass, its masked norm terms M_k a_i² and its clipped sums are each one matmul over the candidates'
concatenated weights (the input is read once, not K times: what makes stacking pay for a wide input such
as ScatterNet's 3969 features), and its norm terms can be looked up in a per-record table built once
(`first_layer_terms`). Element-wise optimisers (SGD, momentum, Adam) applied to the stacked
tensors are exactly K independent optimisers.

This trains on public data only; nothing here is accounted, and nothing needs to be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpltm.dp.ghost import clip_factors
from dpltm.dp.precision import ieee_float32
from dpltm.masks import Masks
from dpltm.networks.lenet import activation_function


class LinearChain(Protocol):
    """A network that is a chain of linear layers over its inputs: a `LeNet` MLP, or a ScatterNet linear or
    MLP head over its cached features (dpltm.networks.scatter)."""

    arch: Any

    def layers_in_order(self) -> list[tuple[str, nn.Linear]]: ...

    def is_activation_after(self, index: int) -> bool: ...


class StackedMLP:
    """The parameters of K networks of one architecture that are chains of linear layers (`LinearChain`)
    and their masks, stacked (candidate axis first)."""

    def __init__(self, models: Sequence[LinearChain], masks: Sequence[Masks]) -> None:
        if not models or len(models) != len(masks):
            raise ValueError("one mask set per candidate network, and at least one candidate")
        arch = models[0].arch
        if any(m.arch != arch for m in models):
            raise ValueError("candidates must share one architecture")
        self.arch = arch
        self.activation: Callable[[Tensor], Tensor] = activation_function(arch.activation)
        layers = [m.layers_in_order() for m in models]
        depth = len(layers[0])
        self.activate_after = [models[0].is_activation_after(i) for i in range(depth)]
        with torch.no_grad():
            stacked_masks = [torch.stack([ms[ls[i][0]].to(ls[i][1].weight.device) for ls, ms in zip(layers, masks)])
                             for i in range(depth)]
            self.weights = [torch.stack([ls[i][1].weight for ls in layers]) * stacked_masks[i]
                            for i in range(depth)]
            for w in self.weights:
                w.requires_grad_()
            self.biases = [torch.stack([ls[i][1].bias for ls in layers]).detach().clone().requires_grad_()
                           for i in range(depth)]
            self.masks = [m.to(self.weights[i].dtype) for i, m in enumerate(stacked_masks)]

    @property
    def size(self) -> int:
        return self.weights[0].shape[0]

    def parameters(self) -> list[Tensor]:
        return [*self.weights, *self.biases]

    @torch.no_grad()
    def keep(self, positions: Sequence[int]) -> None:
        """Only the candidates at `positions` go on (fresh leaf tensors: the caller rebuilds its optimiser)."""
        rows = torch.tensor(list(positions), device=self.weights[0].device)
        self.weights = [w.index_select(0, rows).requires_grad_() for w in self.weights]
        self.biases = [b.index_select(0, rows).requires_grad_() for b in self.biases]
        self.masks = [m.index_select(0, rows) for m in self.masks]

    def forward_layers(self, x: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Inputs and pre-activations (K, B, out) of every layer, and the logits: x is (B, in), shared by
        every candidate (the first layer's input stays (B, in)), or (K, B, in)."""
        h = x
        inputs: list[Tensor] = []
        outputs: list[Tensor] = []
        for i, (w, b, m) in enumerate(zip(self.weights, self.biases, self.masks)):
            inputs.append(h)
            if h.dim() == 2:  # one matmul over every candidate's weights: (B, in) @ (in, K·out)
                k, out, width = w.shape
                z = torch.addmm(b.reshape(1, k * out), h, (w * m).reshape(k * out, width).T)
                z = z.reshape(h.shape[0], k, out).transpose(0, 1)
            else:
                z = torch.baddbmm(b.unsqueeze(1), h, (w * m).transpose(1, 2))
            outputs.append(z)
            h = self.activation(z) if self.activate_after[i] else z
        return inputs, outputs, h

    @torch.no_grad()
    def first_layer_terms(self, x: Tensor, chunk: int = 8192) -> Tensor:
        """(n, K·out) table of M_k a_i² for records x (n, in): the first layer's share of every per-sample
        masked norm, a fixed function of each record (masks do not change), looked up per batch instead
        of recomputed (`clipped_sums(first_terms=...)`)."""
        k, out, width = self.masks[0].shape
        masks = self.masks[0].reshape(k * out, width).T
        return torch.cat([(x[s:s + chunk] * x[s:s + chunk]) @ masks for s in range(0, x.shape[0], chunk)]
                         ) if x.shape[0] else x.new_zeros(0, k * out)

    @torch.no_grad()
    def logits(self, x: Tensor) -> Tensor:
        return self.forward_layers(x)[2]


@ieee_float32()
def clipped_sums(stack: StackedMLP, x: Tensor, y: Tensor, clip: float,
                 first_terms: Tensor | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """Per candidate: Σ_i clip_C(∇ℓ_i) over the surviving weights (and the biases). `first_terms`: the
    batch's rows of `stack.first_layer_terms` (None: computed here)."""
    inputs, outputs, logits = stack.forward_layers(x)
    k = stack.size
    if x.shape[0] == 0:
        return ([torch.zeros_like(w) for w in stack.weights], [torch.zeros_like(b) for b in stack.biases])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.repeat(k), reduction="sum")
    grads = torch.autograd.grad(loss, outputs)  # candidate k's logits depend on its own weights only
    with torch.no_grad():
        rows = x.shape[0]
        sq_norms = x.new_zeros(k, rows)
        for a, g, m in zip(inputs, grads, stack.masks):
            g2 = g * g
            if a.dim() == 2:  # the shared input: M_k a_i² for every candidate in one matmul (or looked up)
                terms = first_terms if first_terms is not None else (a * a) @ m.reshape(-1, m.shape[2]).T
                terms = terms.reshape(rows, k, m.shape[1]).transpose(0, 1)
            else:
                terms = torch.bmm(a * a, m.transpose(1, 2))
            sq_norms += (terms * g2).sum(dim=2) + g2.sum(dim=2)
        factors = clip_factors(sq_norms.sqrt(), clip)
        weight_sums, bias_sums = [], []
        for a, g, m in zip(inputs, grads, stack.masks):
            scaled = g * factors.unsqueeze(2)
            if a.dim() == 2:  # Σ_i c_ki g_ki a_iᵀ for every k in one matmul: (K·out, B) @ (B, in)
                flat = scaled.transpose(0, 1).reshape(rows, -1)
                weight_sums.append((flat.T @ a).reshape(m.shape).mul_(m))
            else:
                weight_sums.append(torch.bmm(scaled.transpose(1, 2), a).mul_(m))
            bias_sums.append(scaled.sum(dim=1))
    return weight_sums, bias_sums


def noisy_step(stack: StackedMLP, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *, clip: float,
               noise_multiplier: float, expected_batch_size: float, generator: torch.Generator,
               first_terms: Tensor | None = None) -> None:
    """One DP-SGD step for every candidate: (clipped sum + N(0, σ²C²) on surviving coordinates) / L."""
    weight_sums, bias_sums = clipped_sums(stack, x, y, clip, first_terms)
    std = noise_multiplier * clip
    with torch.no_grad():
        for param, total, mask in zip(stack.weights, weight_sums, stack.masks):
            noise = torch.randn(total.shape, generator=generator, device=total.device, dtype=total.dtype)
            param.grad = total.add_(noise.mul_(std)).mul_(mask).div_(expected_batch_size)
        for param, total in zip(stack.biases, bias_sums):
            noise = torch.randn(total.shape, generator=generator, device=total.device, dtype=total.dtype)
            param.grad = total.add_(noise.mul_(std)).div_(expected_batch_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def correct_predictions(stack: StackedMLP, x: Tensor, y: Tensor, batch_size: int = 8192) -> Tensor:
    """Whether each candidate's top-1 prediction is right, per record: shape (K, n), on the CPU."""
    parts = [(stack.logits(x[start:start + batch_size]).argmax(dim=2) == y[start:start + batch_size]).cpu()
             for start in range(0, len(y), batch_size)]
    return torch.cat(parts, dim=1) if parts else torch.zeros(stack.size, 0, dtype=torch.bool)


def accuracies(stack: StackedMLP, x: Tensor, y: Tensor, batch_size: int = 8192) -> Tensor:
    """Top-1 accuracy of every candidate, shape (K,)."""
    if len(y) == 0:
        return torch.full((stack.size,), float("nan"))
    return correct_predictions(stack, x, y, batch_size).double().mean(dim=1).float()
