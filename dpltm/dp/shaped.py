"""Noise shaped by model sensitivity (Xiang, Yang & Li; shared/papers/002_f71fb42cb5fa3381.txt).

The slides' idea: the cost is more sensitive to some parameters than to others (w_j =
∂cost/∂θ_j), so put less noise where the cost is sensitive and more where it is not. Two
facts decide how dpltm does it soundly (docs/privacy.md §6):

* w must not come from the private data (it would leak): it is computed once, before
  training, on PUBLIC data (`NoiseContext.public_data`, `--public-dataset`) at the starting
  weights, and fixed for the run. No public data, no shaped noise.
* With the usual L2 clipping ball a Gaussian's privacy is set by its smallest-variance
  direction, so shrinking the noise anywhere costs privacy. Shaping only helps with a
  matching clipping geometry: clip in the norm ‖g / s‖ ≤ C and add N(0, σ²C²·diag(s²)).

Why this is exactly the Gaussian mechanism with multiplier σ. Let D = diag(s) (s > 0, fixed
and data-independent). Each record's clipped contribution u_i = D⁻¹ c_i g_i has ‖u_i‖ ≤ C, so
U = Σ_i u_i has add/remove L2 sensitivity C, and U + N(0, σ²C² I) is the Gaussian mechanism
with noise multiplier σ. The released sum is D(U + Z) = Σ_i c_i g_i + N(0, σ²C² D²): a fixed
linear bijection of that output, i.e. post-processing (Dwork & Roth 2014, Prop. 2.1), with
exactly the same privacy loss distribution. So `effective_for(σ) = σ` and the accountants
apply unchanged. The clipping in ‖g / s‖ is done by `MaskLayout.of(model, dtype, scales)`
(dpltm.dp.ghost), and the noise by `add_gaussian_all(..., scales=s)`.

The scales (our choice). w_j = |∂L̄/∂θ_j| with L̄ the mean cross-entropy over up to
`PUBLIC_RECORDS` public records (the slides' "derivative of the cost on all examples"), then

    s_j ∝ (w_j + ε_w)^(−β),   β = 1/2,   ε_w = 10⁻³ · mean(w over surviving coordinates),

normalised so that the geometric mean of s over the surviving coordinates is 1 (the clipping
ellipsoid {‖g/s‖ ≤ C} has the volume of the ball ‖g‖ ≤ C) and clamped to [1/10, 10], so no
coordinate is clipped or noised more than 10× differently from plain DP-SGD. β = 1/2 is a
moderate compromise: minimising the expected quadratic cost increase Σ_j h_j σ²C² s_j² at a
fixed geometric mean gives s_j ∝ h_j^(−1/2), i.e. β = 1/2 when curvature h_j grows like w_j
(β = 1 if h_j ~ w_j²); a smaller β also keeps the tighter clipping on sensitive coordinates
from biasing their gradients much. `NoiseContext.options["shaped_exponent"]` overrides β.
Pruned coordinates get s = 1 (they carry neither gradient nor noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dpltm.dp.dpd import quantiles
from dpltm.dp.mechanism import NoiseContext, ScaledGaussianNoise
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks
from dpltm.networks.lenet import LeNet
from dpltm.privacy.display import format_sigma

PUBLIC_RECORDS = 4096
"""At most this many public records estimate the sensitivity (the first ones, in order)."""
CHUNK = 1024
EXPONENT = 0.5
SCALE_BOUNDS = (0.1, 10.0)
FLOOR = 1e-3


def _surviving_masks(model: LeNet, masks: Masks | None) -> dict[str, Tensor | None]:
    """Parameter name → bool mask of its surviving coordinates (None: all survive)."""
    out: dict[str, Tensor | None] = {}
    for mask_name, layer in model.layers_in_order():
        mask = (torch.ones_like(layer.weight, dtype=torch.bool) if masks is None
                else masks[mask_name].to(device=layer.weight.device, dtype=torch.bool))
        prefix = mask_name.removesuffix(".weight")
        out[f"{prefix}.weight"] = None if bool(mask.all()) else mask
        out[f"{prefix}.bias"] = None
    return out


def public_sensitivity(model: LeNet, features: Tensor, labels: Tensor,
                       max_records: int = PUBLIC_RECORDS) -> dict[str, Tensor]:
    """w = |∂L̄/∂θ| on public records (L̄: mean cross-entropy over at most `max_records`).

    Never call this with private data (docs/privacy.md §6): w is not privatised.
    """
    n = min(int(labels.shape[0]), max_records)
    if n == 0:
        raise DpltmUserError("shaped noise needs at least one public record")
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    dtype = next(iter(params.values())).dtype
    totals = {name: torch.zeros_like(p) for name, p in params.items()}
    for start in range(0, n, CHUNK):
        x = features[start:min(start + CHUNK, n)].to(device=device, dtype=dtype)
        y = labels[start:min(start + CHUNK, n)].to(device)
        loss = F.cross_entropy(model(x), y, reduction="sum")
        grads = torch.autograd.grad(loss, list(params.values()))
        for name, g in zip(params, grads):
            totals[name] += g.detach()
    return {name: (total / n).abs() for name, total in totals.items()}


def scales_from_sensitivity(sensitivity: dict[str, Tensor], surviving: dict[str, Tensor | None],
                            exponent: float = EXPONENT) -> dict[str, Tensor]:
    """s ∝ (w + ε_w)^(−β), geometric mean 1 over surviving coordinates, clamped (module docstring)."""
    if not (math.isfinite(exponent) and exponent >= 0):
        raise DpltmUserError(f"shaped noise exponent must be ≥ 0, got {exponent}")
    kept = [w.reshape(-1) if surviving.get(name) is None else w[surviving[name]]  # type: ignore[index]
            for name, w in sensitivity.items()]
    pooled = torch.cat(kept).double()
    floor = FLOOR * float(pooled.mean()) + 1e-30
    log_mean = float((-exponent * torch.log(pooled + floor)).mean())
    lo, hi = SCALE_BOUNDS
    out: dict[str, Tensor] = {}
    for name, w in sensitivity.items():
        s = torch.exp(-exponent * torch.log(w.double() + floor) - log_mean).clamp_(lo, hi)
        mask = surviving.get(name)
        if mask is not None:
            s = torch.where(mask, s, torch.ones_like(s))
        out[name] = s.to(w.dtype)
    return out


@dataclass(frozen=True, eq=False)
class ShapedNoise(ScaledGaussianNoise):
    """N(0, σ²C²s²) on surviving coordinates, clipping in ‖g/s‖ ≤ C; effective multiplier σ."""

    sigma: float
    scales: dict[str, Tensor] = field(repr=False)
    public_dataset: str | None = None
    summary: dict[str, float] = field(default_factory=dict)
    name: ClassVar[str] = "shaped"

    @classmethod
    def build(cls, parameter: float, context: NoiseContext | None = None) -> ShapedNoise:
        if context is None or context.public_data is None:
            raise DpltmUserError("shaped noise needs public data: pass --public-dataset NAME (and --public-split)")
        if context.public_dataset is not None and context.public_dataset == context.private_dataset:
            raise DpltmUserError(f"--public-dataset must not be the private dataset ({context.private_dataset}): "
                                 "shaped noise computed on private data leaks it")
        model, public = context.model, context.public_data
        if public.features.dim() != 2 or public.features.shape[1] != model.arch.in_features:
            raise DpltmUserError(f"public data has {tuple(public.features.shape[1:])} features per record, "
                                 f"the network takes {model.arch.in_features}")
        if len(public) and int(public.labels.max()) >= model.arch.num_classes:
            raise DpltmUserError(f"public data has labels up to {int(public.labels.max())}, "
                                 f"the network has {model.arch.num_classes} classes")
        surviving = _surviving_masks(model, context.masks)
        exponent = float(context.options.get("shaped_exponent", EXPONENT))
        scales = scales_from_sensitivity(public_sensitivity(model, public.features, public.labels),
                                         surviving, exponent)
        kept = torch.cat([s.reshape(-1) if surviving[n] is None else s[surviving[n]]  # type: ignore[index]
                          for n, s in scales.items()])
        q_min, q_med, q_max = quantiles(kept.double(), (0.0, 0.5, 1.0))
        summary = {"shaped_scale_min": q_min, "shaped_scale_median": q_med, "shaped_scale_max": q_max}
        return cls(float(parameter), scales, context.public_dataset, summary)

    def coordinate_scales(self) -> dict[str, Tensor | None] | None:
        return dict(self.scales)

    def epoch_metrics(self, model: LeNet, masks: Masks | None, clip: float) -> dict[str, float]:
        return dict(self.summary)

    def description(self) -> str:
        source = f" from public data ({self.public_dataset})" if self.public_dataset else " from public data"
        return (f"sensitivity-shaped Gaussian noise N(0, σ²C²s²), σ = {format_sigma(self.sigma)}, scales s{source} in "
                f"[{self.summary.get('shaped_scale_min', float('nan')):.3g}, "
                f"{self.summary.get('shaped_scale_max', float('nan')):.3g}], clipping in ‖g/s‖ ≤ C: "
                f"exactly the Gaussian mechanism with multiplier σ in the rescaled space")
