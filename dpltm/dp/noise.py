"""Noise plug-ins: how the clipped-gradient sum is perturbed, and how that is accounted.

A mechanism perturbs Σ_i clip(∇ℓ_i) on the *surviving* coordinates only (noise on pruned
coordinates would be discarded by the mask anyway: post-processing, no privacy cost), and
describes itself to the accountant as a dp-accounting event. Adding a mechanism is one class
plus one line in `NOISE_MECHANISMS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from dp_accounting import dp_event
from torch import Tensor

from dpltm.errors import DpltmUserError
from dpltm.privacy.events import dpsgd_event


class NoiseMechanism(Protocol):
    name: ClassVar[str]
    noise_multiplier: float

    def perturb(self, grad_sums: dict[str, Tensor], surviving: dict[str, Tensor | None], clip: float,
                generator: torch.Generator) -> dict[str, Tensor]:
        """The privatised sum: grad_sums plus noise on the surviving coordinates.

        `surviving[name]` holds a parameter's surviving flat indices, or None if all survive.
        """
        ...

    def dp_event(self, sample_rate: float, steps: int) -> dp_event.DpEvent:
        """What `steps` Poisson-sampled applications of this mechanism are, for an accountant."""
        ...


@dataclass(frozen=True)
class GaussianNoise:
    """DP-SGD's Gaussian mechanism (Abadi et al. 2016, Alg. 1): N(0, σ²C²) per coordinate.

    With per-sample L2 clipping to C, adding or removing one record moves the sum by at most C
    (add/remove adjacency), so this is the subsampled Gaussian mechanism with noise multiplier σ.
    """

    noise_multiplier: float
    name: ClassVar[str] = "gaussian"

    def perturb(self, grad_sums: dict[str, Tensor], surviving: dict[str, Tensor | None], clip: float,
                generator: torch.Generator) -> dict[str, Tensor]:
        if self.noise_multiplier == 0.0:
            return dict(grad_sums)
        if clip == float("inf"):
            raise DpltmUserError("Gaussian noise needs a finite clipping norm")
        return {name: add_gaussian(total, surviving.get(name), self.noise_multiplier * clip, generator)
                for name, total in grad_sums.items()}

    def dp_event(self, sample_rate: float, steps: int) -> dp_event.DpEvent:
        return dpsgd_event(sample_rate, self.noise_multiplier, steps)


def add_gaussian(total: Tensor, surviving: Tensor | None, std: float, generator: torch.Generator) -> Tensor:
    """total + N(0, std²) on the surviving coordinates only (drawn only there: cheaper)."""
    out = total.clone()
    if surviving is None:
        noise = torch.randn(total.shape, generator=generator, device=total.device, dtype=total.dtype)
        return out.add_(noise, alpha=std)
    noise = torch.randn(surviving.numel(), generator=generator, device=total.device, dtype=total.dtype)
    out.view(-1).index_add_(0, surviving, noise, alpha=std)
    return out


NOISE_MECHANISMS: dict[str, type] = {"gaussian": GaussianNoise}


def make_noise(name: str, noise_multiplier: float) -> NoiseMechanism:
    try:
        cls = NOISE_MECHANISMS[name]
    except KeyError:
        raise DpltmUserError(f"unknown noise '{name}' (choose from {', '.join(NOISE_MECHANISMS)})") from None
    if noise_multiplier < 0:
        raise DpltmUserError(f"noise multiplier must be ≥ 0, got {noise_multiplier}")
    return cls(noise_multiplier)  # type: ignore[no-any-return]
