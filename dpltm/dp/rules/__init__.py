"""The per-layer registry of DP-SGD's two per-sample operations: the masked squared gradient norm, and
the clipped gradient sum.

A layer's rule receives what one forward pass recorded for it (its inputs a_i) and the per-sample
gradient of the loss with respect to its output, g_i = ∂ℓ_i/∂z_i (one autograd call on Σ_i ℓ_i gives
every g_i, because z_i influences only ℓ_i). From those two it returns, per sample i, the squared
norm of ∇_θ ℓ_i ⊙ M over the layer's *surviving* coordinates, and, given clip factors c_i, the
clipped sum Σ_i c_i ∇_θ ℓ_i ⊙ M (Abadi et al. 2016, Alg. 1; masked: docs/privacy.md §3).

* `nn.Linear` (`linear`): on (B, in) the masked ghost norm ‖(g_i a_iᵀ) ⊙ M‖² = (g_i²)ᵀ M (a_i²), one
  matmul and no per-sample gradient (Goodfellow 2015); on (B, T, in) sequences the ghost norm
  ⟨A_i A_iᵀ, G_i G_iᵀ⟩ of two T × T Grams where they are smaller than the gradient (Li et al. 2022, §4),
  else — and always under a mask, which the Gram identity cannot see — the formed gradient G_iᵀ A_i.
  The clipped sum is the one product (c ⊙ G)ᵀ A a plain backward pass computes.
* `nn.Conv1d`, `nn.Conv2d` (`conv`; any stride, dilation, groups, numeric or 'same'/'valid' padding,
  any padding mode): per-sample weight gradients G_i U_iᵀ from the unfolded input patches U_i.
* `nn.GroupNorm`, `nn.LayerNorm`, `nn.RMSNorm` (`norm`): the affine gradients Σ g_i ⊙ x̂_i and Σ g_i,
  with x̂ recomputed from the recorded input.
* `nn.Embedding` (`embedding`): the norm from g rows grouped by token id — a T × T Gram of equal ids,
  or, under a mask or for long sequences, per-id sums — and the clipped sum by one scatter of c_i g_it.
* Anything else with trainable parameters (Conv3d, transposed convolutions, a user's own layer):
  `torch.func` (`base.FuncRule`) — vmap over samples of the vector-Jacobian product ⟨z(θ, a_i), g_i⟩ —
  which is exact for any layer whose output for one sample depends only on that sample's input. A layer
  type not known to be per-sample is *checked* at every step: the per-sample gradients must add up to
  the batch gradient, or the step is refused (a layer that mixes the samples of a batch, like batch
  normalisation, makes one record's gradient depend on the others and clipping bounds nothing).

Adding a rule for a layer type: a class with `check`, `sq_norms` and `clipped_sums` (see `LayerRule`)
and one `register_rule(LayerType)` line, in a module imported below; tests/dp/test_layer_rules.py
checks every registered rule against torch.func, layer by layer, and tests/dp/test_per_sample.py
whole models.
"""

from dpltm.dp.rules import conv, embedding, linear, norm
from dpltm.dp.rules.base import (
    FUNC_RULE,
    KNOWN_PER_SAMPLE,
    RULES,
    FuncRule,
    LayerCall,
    LayerRule,
    LocalMasks,
    MaterialisedRule,
    WeightAndBiasRule,
    check_adds_up,
    masked_sq_norms,
    register_rule,
    rule_for,
    zero_rows,
)
from dpltm.dp.rules.conv import Conv1dRule, Conv2dRule, ConvRule, conv2d_weight_grads, conv_weight_grads
from dpltm.dp.rules.embedding import EmbeddingRule
from dpltm.dp.rules.linear import LinearRule
from dpltm.dp.rules.norm import GroupNormRule, LayerNormRule

__all__ = [
    "FUNC_RULE", "KNOWN_PER_SAMPLE", "RULES", "Conv1dRule", "Conv2dRule", "ConvRule", "EmbeddingRule", "FuncRule",
    "GroupNormRule", "LayerCall", "LayerNormRule", "LayerRule", "LinearRule", "LocalMasks", "MaterialisedRule",
    "WeightAndBiasRule", "check_adds_up", "conv", "conv2d_weight_grads", "conv_weight_grads", "embedding", "linear",
    "masked_sq_norms", "norm", "register_rule", "rule_for", "zero_rows",
]
