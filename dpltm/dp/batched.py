"""K masked networks of one architecture trained side by side by DP-SGD, in one set of kernels.

Used to compare tickets under the noise a planned private run will see (dpltm.selection.noise_aware):
every candidate gets the same Poisson batches (common random numbers, so differences between
candidates are not sampling luck) and its own independent noise. Parameters are stacked along
a leading candidate axis, (K, out, in) and (K, out), so a forward pass is one batched matmul
per layer; the per-sample masked norms use the ghost identity of dpltm.dp.ghost,

    ‖(g_i a_iᵀ) ⊙ M‖² = Σ_jk g_ij² M_jk a_ik²,

batched over candidates. Element-wise optimisers (SGD, momentum, Adam) applied to the stacked
tensors are exactly K independent optimisers.

This trains on public data only; nothing here is accounted, and nothing needs to be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dpltm.dp.ghost import clip_factors
from dpltm.model import LeNet, Masks, activation_function


class StackedMLP:
    """The parameters of K `LeNet` MLPs of one architecture and their masks, stacked (candidate axis
    first)."""

    def __init__(self, models: Sequence[LeNet], masks: Sequence[Masks]) -> None:
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

    def forward_layers(self, x: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Inputs and pre-activations of every layer, and the logits: x is (B, in) or (K, B, in)."""
        h = x.expand(self.size, *x.shape) if x.dim() == 2 else x
        inputs: list[Tensor] = []
        outputs: list[Tensor] = []
        for i, (w, b, m) in enumerate(zip(self.weights, self.biases, self.masks)):
            inputs.append(h)
            z = torch.baddbmm(b.unsqueeze(1), h, (w * m).transpose(1, 2))
            outputs.append(z)
            h = self.activation(z) if self.activate_after[i] else z
        return inputs, outputs, h

    @torch.no_grad()
    def logits(self, x: Tensor) -> Tensor:
        return self.forward_layers(x)[2]


def clipped_sums(stack: StackedMLP, x: Tensor, y: Tensor, clip: float) -> tuple[list[Tensor], list[Tensor]]:
    """Per candidate: Σ_i clip_C(∇ℓ_i) over the surviving weights (and the biases)."""
    inputs, outputs, logits = stack.forward_layers(x)
    k = stack.size
    if x.shape[0] == 0:
        return ([torch.zeros_like(w) for w in stack.weights], [torch.zeros_like(b) for b in stack.biases])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.repeat(k), reduction="sum")
    grads = torch.autograd.grad(loss, outputs)  # candidate k's logits depend on its own weights only
    with torch.no_grad():
        sq_norms = x.new_zeros(k, x.shape[0])
        for a, g, m in zip(inputs, grads, stack.masks):
            g2 = g * g
            sq_norms += torch.bmm(a * a, m.transpose(1, 2)).mul_(g2).sum(dim=2) + g2.sum(dim=2)
        factors = clip_factors(sq_norms.sqrt(), clip)
        weight_sums, bias_sums = [], []
        for a, g, m in zip(inputs, grads, stack.masks):
            scaled = g * factors.unsqueeze(2)
            weight_sums.append(torch.bmm(scaled.transpose(1, 2), a).mul_(m))
            bias_sums.append(scaled.sum(dim=1))
    return weight_sums, bias_sums


def noisy_step(stack: StackedMLP, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *, clip: float,
               noise_multiplier: float, expected_batch_size: float, generator: torch.Generator) -> None:
    """One DP-SGD step for every candidate: (clipped sum + N(0, σ²C²) on surviving coordinates) / L."""
    weight_sums, bias_sums = clipped_sums(stack, x, y, clip)
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
