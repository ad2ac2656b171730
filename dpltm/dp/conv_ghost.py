"""Per-sample norms and clipped sums of an unmasked convolution without keeping per-sample gradients.

Sample i's weight gradient, per group, is G_i U_iᵀ: G_i (out, T) the output gradient and U_i (K, T) the unfolded
input patches over the T output positions. Its squared norm is either formed directly (B·out·K numbers, one
sample chunk at a time) or, when T² < out·K, read off two T×T Gram matrices,

    ‖G_i U_iᵀ‖² = Σ_{t,t'} (U_iᵀU_i)_{tt'} (G_iᵀG_i)_{tt'},

the ghost norm for sequences and convolutions (Li et al. 2022, "Large language models can be strong
differentially private learners", §4; Bu et al. 2022, "Scalable and efficient training of large convolutional
neural networks with differential privacy": "mixed ghost clipping" takes the cheaper of the two per layer). The
clipped sum Σ_i c_i G_i U_iᵀ is one contraction over samples and positions, the product a plain backward pass
computes with the output gradient scaled by c. A masked weight has no Gram identity: its norms are formed (a chunk
of samples at a time) or, at few positions, summed over position pairs;
its clipped sum is the contraction times the mask, (Σ_i c_i G_i U_iᵀ) ⊙ M.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHUNK_ELEMENTS = 1 << 20
"""Formed per-sample gradients are made this many numbers at a time at most (4 MB in float32): a chunk adds to the
peak memory of a step that holds the forward pass's graph (16 MB chunks put the masked transformer of
benchmarks/bench_models.py 14 MB above the dense step's peak)."""


def conv_operands(module: nn.Conv1d | nn.Conv2d, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(U, G): the unfolded input patches (B, groups, K, T) and the output gradient (B, groups, out/groups, T) of a
    1-D or 2-D convolution. Padding other than numeric zeros ('same', reflect, replicate, circular) is applied
    first, exactly as the layer does; a 1-D convolution is a 2-D one of height 1."""
    kernel, dilation, stride, padding = (tuple(v) if isinstance(v, tuple) else v for v in (
        module.kernel_size, module.dilation, module.stride, module.padding))
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * len(kernel)
    if isinstance(module, nn.Conv1d):
        a = a.unsqueeze(2)
        kernel, dilation, stride, padding = ((1, *kernel), (1, *dilation), (1, *stride),  # type: ignore[misc]
                                             (0, *padding))  # type: ignore[misc]
    patches = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)  # type: ignore[arg-type]
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


def clipped_weight_sum(patches: Tensor, grads: Tensor, factors: Tensor, shape: Any) -> Tensor:
    """Σ_i c_i G_i U_iᵀ, reshaped to the weight's shape: one contraction, no per-sample gradient."""
    scaled = grads.to(factors.dtype) * factors.view(-1, 1, 1, 1)
    return torch.einsum("bgot,bgkt->gok", scaled, patches.to(factors.dtype)).reshape(shape)


def clipped_bias_sum(grads: Tensor, factors: Tensor) -> Tensor:
    """Σ_i c_i Σ_t G_i[:, t], in the layer's channel order (group-major): the positions summed first, then B·out
    numbers weighted (an einsum over (b, t) at once summed a permuted view, 50× slower on a sequence's g)."""
    return factors @ grads.to(factors.dtype).sum(dim=3).reshape(grads.shape[0], -1)
