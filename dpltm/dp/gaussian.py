"""DP-SGD's Gaussian noise plug-in (Abadi et al. 2016)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dpltm.dp.mechanism import NoiseContext, ScaledGaussianNoise
from dpltm.privacy.display import format_sigma


@dataclass(frozen=True)
class GaussianNoise(ScaledGaussianNoise):
    """DP-SGD's Gaussian mechanism (Abadi et al. 2016, Alg. 1): N(0, σ²C²) per coordinate.

    With per-sample L2 clipping to C, adding or removing one record moves the sum by at most C
    (add/remove adjacency), so this is the subsampled Gaussian mechanism with multiplier σ.
    """

    sigma: float
    name: ClassVar[str] = "gaussian"

    @classmethod
    def build(cls, parameter: float, context: NoiseContext | None = None) -> GaussianNoise:
        return cls(float(parameter))

    def description(self) -> str:
        return f"Gaussian DP-SGD noise, multiplier σ = {format_sigma(self.sigma)}"
