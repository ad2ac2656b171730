"""What a noise plug-in is: the context it is built from, the protocol it satisfies, and the
shared body of the plug-ins that add (possibly shaped) Gaussian noise.

A mechanism perturbs Σ_i clip(∇ℓ_i) on the *surviving* coordinates only (noise on pruned
coordinates would be discarded by the mask anyway: post-processing, no privacy cost) and
states what it is to an accountant. Every plug-in here reduces, exactly, to the Poisson-
subsampled Gaussian mechanism under add/remove-one adjacency with some *effective* noise
multiplier (noise std / per-record sensitivity); that multiplier is what the ledger records, so
all accountants apply unchanged. The registry of plug-ins is dpltm.dp.noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from dp_accounting import dp_event
from torch import Tensor

from dpltm.data.types import LabeledTensors
from dpltm.errors import DpltmUserError
from dpltm.masks import Masks
from dpltm.networks.lenet import LeNet
from dpltm.privacy.events import dpsgd_event


@dataclass(frozen=True)
class NoiseContext:
    """What a plug-in may need to build itself: the network and its ticket's masks (keyed by mask name),
    and public data if any."""

    model: LeNet
    clip: float
    private_dataset: str
    masks: Masks | None = None
    """None: the dense network."""
    public_data: LabeledTensors | None = None
    public_dataset: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


class NoiseMechanism(Protocol):
    name: ClassVar[str]

    @property
    def parameter(self) -> float:
        """The plug-in's own noise parameter (what `--sigma` sets)."""
        ...

    @property
    def effective_noise_multiplier(self) -> float:
        """Gaussian noise multiplier under add/remove-one adjacency: what the accountant sees."""
        ...

    def coordinate_scales(self) -> dict[str, Tensor | None] | None:
        """Per-parameter positive scales s (noise ∝ s, clipping in the norm ‖g / s‖), or None."""
        ...

    def perturb(self, grad_sums: dict[str, Tensor], surviving: dict[str, Tensor | None], clip: float,
                generator: torch.Generator) -> dict[str, Tensor]:
        """The privatised sum: grad_sums plus noise on the surviving coordinates.

        `surviving[name]` holds a parameter's surviving flat indices, or None if all survive.
        """
        ...

    def epoch_metrics(self, model: LeNet, masks: Masks | None, clip: float) -> dict[str, float]:
        """Extra per-epoch figures to log (e.g. DPD's implied dropout rates); may be empty."""
        ...

    def description(self) -> str:
        """One line for the privacy statement."""
        ...


def dp_event_of(mechanism: NoiseMechanism, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """`steps` Poisson-sampled applications: SelfComposed(PoissonSampled(q, Gaussian(σ_eff)), T)."""
    return dpsgd_event(sample_rate, mechanism.effective_noise_multiplier, steps)


ONE_DRAW_MAX = 1 << 24
"""Above this many surviving coordinates (64 MiB of float32 draws) the noise is drawn per parameter."""


def add_gaussian_all(sums: dict[str, Tensor], surviving: dict[str, Tensor | None], std: float,
                     generator: torch.Generator, scales: dict[str, Tensor | None] | None = None) -> dict[str, Tensor]:
    """sums + N(0, std²·s²) on each parameter's surviving coordinates only (drawn only there: cheaper).

    One draw for every parameter at once: a vector of standard normals as long as all surviving
    coordinates together, split in the dict's order (`surviving[name]` None: all of the parameter's
    coordinates survive). The CUDA-graph step draws the same vector in one kernel and scatters it
    (`dpltm.dp.graphed.StaticShapeDpStep`), so both steps give the same numbers on the same generator.
    Adds in place: the sums are fresh gradient sums owned by the caller. Sums on several devices or
    dtypes (a user's model split across devices), or more than `ONE_DRAW_MAX` surviving coordinates (a big
    model, whose one draw would hold a second copy of it), get one draw per parameter: the same distribution.
    """
    scales = scales or {}
    tensors = list(sums.values())
    if not tensors:
        return {}
    counts = [total.numel() if surviving.get(name) is None else surviving[name].numel()  # type: ignore[union-attr]
              for name, total in sums.items()]
    first = tensors[0]
    if sum(counts) <= ONE_DRAW_MAX and all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        draws = torch.randn(sum(counts), generator=generator, device=first.device, dtype=first.dtype).split(counts)
    else:
        draws = tuple(torch.randn(n, generator=generator, device=t.device, dtype=t.dtype)
                      for n, t in zip(counts, tensors, strict=True))
    out = {}
    for (name, total), noise in zip(sums.items(), draws, strict=True):
        kept, scale = surviving.get(name), scales.get(name)
        if scale is not None:
            scale = scale.to(device=total.device, dtype=total.dtype).reshape(-1)
            noise = noise * (scale if kept is None else scale.index_select(0, kept))
        if kept is None:
            out[name] = total.add_(noise.view_as(total), alpha=std)
        else:
            total.view(-1).index_add_(0, kept, noise, alpha=std)
            out[name] = total
    return out



def add_gaussian(total: Tensor, surviving: Tensor | None, std: float, generator: torch.Generator,
                 scale: Tensor | None = None) -> Tensor:
    """total + N(0, std²·scale²) on one parameter's surviving coordinates (None: all): `add_gaussian_all` for
    one sum, the helper a plug-in of its own may call. Adds in place."""
    return add_gaussian_all({"sum": total}, {"sum": surviving}, std, generator, {"sum": scale})["sum"]


class ScaledGaussianNoise:
    """Shared body of the plug-ins that add Gaussian noise of std `PER_PARAMETER`·σ·C·s.

    A subclass sets `PER_PARAMETER` (noise std per unit of its own σ, in units of C: its registry line's
    `per_parameter`, dpltm.dp.noise) and, if it
    shapes the noise, `coordinate_scales`. With per-sample clipping to C (in ‖g/s‖ when scaled)
    the add/remove sensitivity of the clipped sum is C, so the effective multiplier — noise std
    over sensitivity, what the accountant sees (Abadi et al. 2016; Mironov et al. 2019) — is
    `PER_PARAMETER`·σ.
    """

    sigma: float
    PER_PARAMETER: ClassVar[float] = 1.0

    @property
    def parameter(self) -> float:
        return self.sigma

    @property
    def effective_noise_multiplier(self) -> float:
        return self.PER_PARAMETER * self.sigma

    def coordinate_scales(self) -> dict[str, Tensor | None] | None:
        return None

    def noise_std(self, clip: float) -> float:
        """The noise's standard deviation per unit of s: `PER_PARAMETER`·σ·C (0 without noise)."""
        if self.sigma == 0.0:
            return 0.0
        if clip == float("inf"):
            raise DpltmUserError(f"{type(self).__name__} needs a finite clipping norm")
        return self.PER_PARAMETER * self.sigma * clip

    def perturb(self, grad_sums: dict[str, Tensor], surviving: dict[str, Tensor | None], clip: float,
                generator: torch.Generator) -> dict[str, Tensor]:
        std = self.noise_std(clip)
        if std == 0.0:
            return dict(grad_sums)
        return add_gaussian_all(grad_sums, surviving, std, generator, self.coordinate_scales())

    def epoch_metrics(self, model: LeNet, masks: Masks | None, clip: float) -> dict[str, float]:
        return {}
