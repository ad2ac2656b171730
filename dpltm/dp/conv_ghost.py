"""Per-sample norms and clipped sums of a convolution, masked or not, without torch.func.

Sample i's weight gradient, per group, is G_i U_iᵀ: G_i (out, T) the output gradient and U_i (K, T) the unfolded
input patches over the T output positions. Its squared norm is either formed directly (B·out·K numbers, one
sample chunk at a time) or, when T² < out·K, read off two T×T Gram matrices,

    ‖G_i U_iᵀ‖² = Σ_{t,t'} (U_iᵀU_i)_{tt'} (G_iᵀG_i)_{tt'},

the ghost norm for sequences and convolutions (Li et al. 2022, "Large language models can be strong
differentially private learners", §4; Bu et al. 2022, "Scalable and efficient training of large convolutional
neural networks with differential privacy": "mixed ghost clipping" takes the cheaper of the two per layer). A
masked weight has no Gram identity: its norms are formed (a chunk of samples at a time) or, at few positions,
summed over position pairs. The clipped sum Σ_i c_i (G_i U_iᵀ) ⊙ M is, where the gradients were formed as one
grouped weight gradient (the CPU, many positions), B numbers a coordinate from them; else the product a plain
backward pass computes with the output gradient scaled by c, then the mask: on the CPU by the layer's own
weight-gradient kernel, elsewhere as one contraction of the unfolded patches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHUNK_ELEMENTS = 1 << 20
"""Formed per-sample gradients are made this many numbers at a time at most (4 MB in float32): a chunk adds to the
peak memory of a step that holds the forward pass's graph (16 MB chunks put the masked transformer of
benchmarks/bench_models.py 14 MB above the dense step's peak)."""


def padded_input(module: nn.Conv1d | nn.Conv2d, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input with any padding other than numeric zeros ('same', 'valid', reflect, replicate, circular) applied
    exactly as the layer does, and the numeric zero padding left to the kernel."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return F.pad(a, module._reversed_padding_repeated_twice, mode=mode), (0,) * len(module.kernel_size)
    return a, tuple(module.padding)


def conv_operands(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(U, G): the unfolded input patches (B, groups, K, T) and the output gradient (B, groups, out/groups, T) of a
    1-D or 2-D convolution (its padding as `padded_input`); a 1-D convolution is a 2-D one of height 1."""
    a, padding = padded_input(module, a)
    kernel, dilation, stride = (tuple(v) for v in (module.kernel_size, module.dilation, module.stride))
    if isinstance(module, nn.Conv1d):
        a = a.unsqueeze(2)
        kernel, dilation, stride, padding = (1, *kernel), (1, *dilation), (1, *stride), (0, *padding)
    patches = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    rows, groups = a.shape[0], module.groups
    return (patches.reshape(rows, groups, patches.shape[1] // groups, -1),
            g.reshape(rows, groups, module.out_channels // groups, -1))


def use_grams(positions: int, inputs: int, outputs: int) -> bool:
    """Whether two (T, T) Grams a sample take less memory than one (out, K) gradient (Li et al. 2022, §4)."""
    return 2 * positions * positions < inputs * outputs


def ghost_pays(patches: Tensor, grads: Tensor) -> bool:
    """`use_grams` for these operands: T positions, K inputs and out outputs a group."""
    return use_grams(patches.shape[-1], patches.shape[2], grads.shape[2])


PAIRS_MAX_POSITIONS = 4
"""A masked layer with at most this many positions takes its norms from position pairs (`masked_pair_norms`):
measured on one CPU core against forming the gradients, 18× faster at one position (512 × 4608, ResNet-18's last
stage on 32×32 inputs), 1.3–2.6× at four, 2–60× slower from nine on."""


def masked_pair_norms(patches: Tensor, grads: Tensor, mask: Tensor) -> Tensor:
    """‖(G_i U_iᵀ) ⊙ M‖² per sample, as Σ_{t ≤ t'} w_tt' (g_it ⊙ g_it')ᵀ M (u_it ⊙ u_it') (w = 1 on the diagonal,
    2 off it): expanding the square of (G_i U_iᵀ)_ok = Σ_t g_ito u_itk under the mask. One product with M per pair of
    positions and no (out, K) gradient formed; at one position it is the masked ghost norm of a Linear layer,
    (g_i²)ᵀ M (a_i²) (Goodfellow 2015)."""
    first, second = torch.triu_indices(patches.shape[-1], patches.shape[-1], device=patches.device)
    weight = torch.where(first == second, 1.0, 2.0).to(grads.dtype)
    left = torch.einsum("bgop,gok->bgkp", grads[..., first] * grads[..., second] * weight, mask)
    return left.mul_(patches[..., first] * patches[..., second]).sum(dim=(1, 2, 3))


def weight_sq_norms(patches: Tensor, grads: Tensor, mask: Tensor | None = None) -> Tensor:
    """‖(G_i U_iᵀ) ⊙ M‖² per sample (summed over groups): without a mask by the Grams or by forming the gradients,
    whichever is cheaper; with one (groups, out/groups, K) from position pairs where there are few positions, else
    by forming them, a chunk of samples at a time."""
    if mask is None and ghost_pays(patches, grads):
        return (patches.transpose(2, 3) @ patches).mul_(grads.transpose(2, 3) @ grads).sum(dim=(1, 2, 3))
    if mask is not None and patches.shape[-1] <= PAIRS_MAX_POSITIONS:
        return masked_pair_norms(patches, grads.to(patches.dtype), mask.to(patches.dtype))
    per_sample = grads.shape[1] * grads.shape[2] * patches.shape[2]
    step = max(1, CHUNK_ELEMENTS // max(per_sample, 1))
    norms = []
    for i in range(0, grads.shape[0], step):
        formed = grads[i:i + step] @ patches[i:i + step].transpose(2, 3)  # (b, groups, out, K), no copy of U
        # one reduction reads the (masked) chunk: no squared copy written first
        norms.append(torch.linalg.vector_norm(formed if mask is None else formed.mul_(mask), dim=(1, 2, 3)).square())
    return torch.cat(norms)


GROUPED_MIN_POSITIONS = 128
"""On the CPU, a convolution with at least this many output positions forms its per-sample gradients by its own
weight-gradient kernel with the samples as groups, not by a product with unfolded patches: measured on one core
(ResNet-18's and the GroupNorm CNN's layers in benchmarks/bench_models.py), 1.3–2.7× faster at 196–1024
positions, slower at 64 and fewer. Left to the patches on other devices, where it is unmeasured."""


def grams_cost_less(positions: int, inputs: int, outputs: int) -> bool:
    """Whether two T×T Grams a sample take fewer multiply-adds than forming its (out, K) gradient:
    T·(K + out) < out·K. Formed gradients come a chunk at a time, so this, not their memory, decides."""
    return positions * (inputs + outputs) < inputs * outputs


def takes_the_kernel(t: Tensor) -> bool:
    """Whether a convolution's sum on `t`'s device is its weight-gradient kernel (the CPU, where dpltm.dp.precision
    pins oneDNN's float32 convolutions) rather than a contraction of its unfolded patches (`clipped_weight_sum`)."""
    return t.device.type == "cpu"


def forms_by_groups(module: nn.Conv1d | nn.Conv2d, g: Tensor, masked: bool) -> bool:
    """Whether this layer's norms come from `grouped_grads` (`GROUPED_MIN_POSITIONS`): a CPU convolution with
    many positions whose norm is not cheaper by the Grams (an unmasked weight) or must be formed (a masked one)."""
    positions, outputs = g[0, 0].numel(), module.out_channels // module.groups
    if not takes_the_kernel(g) or positions < GROUPED_MIN_POSITIONS:
        return False
    return masked or not grams_cost_less(positions, module.weight[0].numel(), outputs)


def grouped_grads(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor, mask: Tensor | None) -> Iterator[Tensor]:
    """The per-sample weight gradients (b, out, K) ⊙ M, a chunk of b samples at a time, each chunk formed as ONE
    convolution's weight gradient: the chunk's samples side by side as channel groups (b·groups groups), so group
    s·groups + j of the result is sample s's gradient of the layer's group j. No unfolded patches."""
    a, padding = padded_input(module, a)
    step = max(1, CHUNK_ELEMENTS // module.weight.numel())
    for i in range(0, g.shape[0], step):
        rows_a, rows_g = a[i:i + step], g[i:i + step]
        b = rows_g.shape[0]
        shape_only = rows_g.new_empty(1).expand(b * module.out_channels, *module.weight.shape[1:])
        formed = torch.ops.aten.convolution_backward(
            rows_g.reshape(1, -1, *rows_g.shape[2:]), rows_a.reshape(1, -1, *rows_a.shape[2:]), shape_only, None,
            module.stride, padding, module.dilation, False, [0] * len(padding), b * module.groups,
            [False, True, False])[1].reshape(b, module.out_channels, -1)
        yield formed if mask is None else formed.mul_(mask.reshape(module.out_channels, -1))


def formed_sum(chunks: Iterable[Tensor], factors: Tensor, finite: Tensor | None) -> Tensor:
    """Σ_i c_i ∇_W ℓ_i from formed gradients, chunk after chunk in one order (whether the chunks were kept from the
    norms or formed again: the same bits); a row not finite adds exactly zero."""
    total, start = None, 0
    for formed in chunks:
        rows = formed.shape[0]
        if finite is not None:
            formed = torch.where(finite[start:start + rows].view(-1, 1, 1), formed, 0.0)
        part = factors[start:start + rows] @ formed.reshape(rows, -1).to(factors.dtype)
        total, start = part if total is None else total.add_(part), start + rows
    assert total is not None, "a batch has at least one row here"
    return total


def clipped_weight_sum(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor, factors: Tensor,
                       patches: Tensor | None = None) -> Tensor:
    """Σ_i c_i G_i U_iᵀ in the weight's shape. On the CPU the layer's own weight-gradient kernel on the output
    gradient scaled by c, the product a plain backward pass computes: no patches unfolded (a contraction over samples
    and positions copied the patches into its layout first, 3.5× slower). On other devices one contraction of the
    unfolded patches (`patches`, kept from the norms, or unfolded again): cuDNN may run a float32 convolution in
    TF32 (its default), which dpltm.dp.precision does not pin, and a sum rounded apart from its norms could exceed C."""
    if not takes_the_kernel(a):
        if patches is None:
            patches, grads = conv_operands(module, a, g)
        else:
            grads = g.reshape(*patches.shape[:2], module.out_channels // module.groups, -1)
        scaled = grads.to(factors.dtype) * factors.view(-1, 1, 1, 1)
        return torch.einsum("bgot,bgkt->gok", scaled, patches.to(factors.dtype)).reshape(module.weight.shape)
    a, padding = padded_input(module, a.to(factors.dtype))
    scaled = g.to(factors.dtype) * factors.view(-1, *[1] * (g.dim() - 1))
    shape_only = scaled.new_empty(1).expand(module.weight.shape)
    return torch.ops.aten.convolution_backward(scaled, a, shape_only, None, module.stride, padding, module.dilation,
                                               False, [0] * len(padding), module.groups, [False, True, False])[1]


def clipped_bias_sum(grads: Tensor, factors: Tensor) -> Tensor:
    """Σ_i c_i Σ_t G_i[:, t], in the layer's channel order (group-major): the positions summed first, then B·out
    numbers weighted (an einsum over (b, t) at once summed a permuted view, 50× slower on a sequence's g)."""
    return factors @ grads.to(factors.dtype).sum(dim=3).reshape(grads.shape[0], -1)
