"""Differentially private dropout (Ermiş & Cemgil, shared/papers/000_53eedf11a90bd2cc.txt).

Algorithm 1 clips each per-sample gradient to L2 norm C and adds ξ' ~ N(0, 4C²σ²·I) to the
clipped sum; §4.2 identifies this noise with Gaussian dropout's additive form
N(0, α·diag(θ²)), so each weight carries an implied dropout rate α = 4C²σ²/θ².

Privacy (docs/privacy.md §4). The mechanism *is* the Gaussian mechanism. The paper argues under
replace-one adjacency, where the clipped sum moves by at most 2C, so the noise std 2Cσ is
multiplier σ. dpltm accounts under add/remove-one adjacency (what Poisson subsampling is
analysed under, Mironov, Talwar & Zhang 2019): adding or removing one record moves the sum
by at most C, so std 2Cσ is the Gaussian mechanism with multiplier 2σ. That effective
multiplier is what the ledger records, so the sound PLD/RDP accountants apply unchanged
(`effective_for(σ) = 2σ`, `parameter_for(σ_eff) = σ_eff/2`). The paper's own zCDP and
advanced-composition figures are in dpltm.privacy.comparisons, as labelled comparisons only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpltm.dp.mechanism import NoiseContext, ScaledGaussianNoise
from dpltm.dp.noise import NOISE_PLUGINS
from dpltm.masks import Masks
from dpltm.networks.lenet import LeNet
from dpltm.privacy.display import format_sigma

#: torch.quantile refuses very large inputs; larger layers are summarised on an even stride.
QUANTILE_SAMPLE = 1_000_000


def quantiles(values: Tensor, probs: tuple[float, ...]) -> list[float]:
    """torch.quantile of a flat tensor, on a deterministic strided sample when it is large."""
    flat = values.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE:
        step = math.ceil(flat.numel() / QUANTILE_SAMPLE)
        flat = flat[::step]
    q = torch.tensor(probs, dtype=flat.dtype, device=flat.device)
    return [float(v) for v in torch.quantile(flat, q)]


def dropout_rates(model: LeNet, masks: Masks | None, clip: float, sigma: float) -> dict[str, Tensor]:
    """α = 4C²σ²/θ² for each surviving weight, per layer (keyed by layer name, e.g. hidden.0).

    §4.2 of the paper: N(0, 4C²σ²) = N(0, α θ²). A surviving weight that is exactly 0 has
    α = ∞. Weights are read from the model (a released iterate: post-processing).
    """
    variance = 4.0 * clip * clip * sigma * sigma
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for mask_name, layer in model.layers_in_order():
            theta = layer.weight.detach()
            theta = (theta if masks is None else theta[masks[mask_name].to(theta.device, torch.bool)]).double()
            rates = torch.zeros_like(theta) if variance == 0.0 else variance / (theta * theta)
            out[mask_name.removesuffix(".weight")] = rates
    return out


@dataclass(frozen=True)
class DropoutNoise(ScaledGaussianNoise):
    """DPD noise N(0, 4C²σ²) on the surviving coordinates (Alg. 1 line 7); effective multiplier
    2σ under add/remove adjacency (std 2Cσ over sensitivity C; module docstring)."""

    sigma: float
    name: ClassVar[str] = "dpd"
    PER_PARAMETER: ClassVar[float] = NOISE_PLUGINS["dpd"].per_parameter

    @classmethod
    def build(cls, parameter: float, context: NoiseContext | None = None) -> DropoutNoise:
        return cls(float(parameter))

    def epoch_metrics(self, model: LeNet, masks: Masks | None, clip: float) -> dict[str, float]:
        """Median and quartiles of the implied dropout rates α per layer (docs/privacy.md §4)."""
        if not math.isfinite(clip):
            return {}
        metrics: dict[str, float] = {}
        for layer, alpha in dropout_rates(model, masks, clip, self.sigma).items():
            if alpha.numel() == 0:
                continue
            q25, median, q75 = quantiles(alpha, (0.25, 0.5, 0.75))
            metrics[f"dpd_alpha_q25/{layer}"] = q25
            metrics[f"dpd_alpha_median/{layer}"] = median
            metrics[f"dpd_alpha_q75/{layer}"] = q75
        return metrics

    def description(self) -> str:
        return (f"DPD noise N(0, 4C²σ²) with σ = {format_sigma(self.sigma)} (Ermiş & Cemgil, Alg. 1): "
                f"multiplier σ under "
                f"the paper's replace-one reading (sensitivity 2C), accounted under add/remove (sensitivity C) "
                f"as the Gaussian mechanism with multiplier 2σ = {format_sigma(2 * self.sigma)}")
