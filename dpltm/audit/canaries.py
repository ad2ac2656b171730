"""Canaries and the attacks that score them (Steinke, Nasr & Jagielski 2023; Nasr et al. 2023).

Each of m canaries is included in training independently with probability 1/2 (a fresh OS-CSPRNG
draw unless seeded; the attack never sees the draw). Two threat models:

- **white-box gradient canaries**: canary i is a record whose gradient is a Dirac on one surviving
  weight c_i, of norm `magnitude` ≫ C, so clipping brings it to exactly C (Nasr et al.'s "Dirac
  canary"). Included canaries are extra records of the Poisson-sampled dataset (N grows by their
  number, as the accountant is told); their clipped gradients enter the clipped sum before the
  noise, through the same clip and noise code as every record. The attack observes the released
  noisy gradients at c_i (`iterates`: what the DP-SGD iterates reveal; a likelihood-ratio score of
  the mixture (1−q)·N(0, σ²) + q·N(1, σ²) against N(0, σ²) in units of C) or only the final model
  (`final_model`: how far θ[c_i] moved against the canary's gradient).
- **black-box input canaries**: out-of-distribution records (features uniform over the data's
  range, random labels) added to the training set; the attack scores each by its negative loss on
  the released model.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpltm.errors import DpltmUserError

THREAT_MODELS = ("white-box", "black-box")
#: ‖canary gradient‖ / C before clipping: with clipping on it is cut to C; a broken clip lets it through.
CANARY_MAGNITUDE_OVER_CLIP = 100.0


def inclusion_bits(m: int, seed: int | None) -> np.ndarray:
    """m independent fair coins: which canaries go into training (secret from the attack)."""
    rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
    return rng.random(m) < 0.5


@dataclass
class GradientCanaries:
    """White-box canaries: one surviving weight each; the included ones are extra records."""

    names: list[str]
    """parameter name of canary i's coordinate"""
    flat: np.ndarray
    """flat index of canary i's coordinate within its parameter"""
    included: np.ndarray
    clip: float
    magnitude: float
    released: list[Tensor] = field(default_factory=list)
    """per step: the released noisy gradient sum at every canary's coordinate, in units of C"""
    theta0: np.ndarray | None = None
    _by_parameter: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @classmethod
    def draw(cls, model: torch.nn.Module, surviving: dict[str, Tensor | None], m: int, clip: float,
             seed: int | None, features: Tensor | None = None) -> GradientCanaries:
        """m distinct surviving weights (never biases) and the inclusion bits.

        Quiet coordinates first: first-layer weights on an input feature that is 0 in every
        training record (MNIST's border pixels) get no gradient from the data, so a canary there
        competes with the noise alone, as in Nasr et al.'s white-box audit; the rest are drawn
        uniformly from the other surviving weights. (Choosing by the data is allowed: the bound
        needs the canaries independent of their inclusion bits only.)"""
        rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed + 1)
        quiet: list[tuple[str, int]] = []
        loud: list[tuple[str, int]] = []
        first = _first_layer(model, None if features is None else features.shape[1])
        for name, parameter in model.named_parameters():
            if not name.endswith(".weight"):
                continue
            indices = surviving.get(name)
            flat = np.arange(parameter.numel()) if indices is None else indices.detach().cpu().numpy()
            if name == first and features is not None:
                silent = (features != 0).sum(0).cpu().numpy() == 0  # a feature no record ever sets
                is_quiet = silent[flat % parameter.shape[1]]
                quiet += [(name, int(i)) for i in flat[is_quiet]]
                loud += [(name, int(i)) for i in flat[~is_quiet]]
            else:
                loud += [(name, int(i)) for i in flat]
        if m > len(quiet) + len(loud):
            raise DpltmUserError(f"--canaries {m}: the network has only {len(quiet) + len(loud)} surviving weights "
                                 "to put them on")
        take_quiet = min(m, len(quiet))
        picked = [quiet[i] for i in rng.choice(len(quiet), size=take_quiet, replace=False)] if take_quiet else []
        if m > take_quiet:
            picked += [loud[i] for i in rng.choice(len(loud), size=m - take_quiet, replace=False)]
        order = rng.permutation(m)
        names = [picked[i][0] for i in order]
        flats = np.asarray([picked[i][1] for i in order])
        return cls(names, flats, inclusion_bits(m, seed), clip, CANARY_MAGNITUDE_OVER_CLIP * clip)

    @property
    def included_ids(self) -> np.ndarray:
        """Canary ids of the pseudo-records N, N+1, … appended to the dataset, in that order."""
        return np.flatnonzero(self.included)

    def start(self, model: torch.nn.Module, device: torch.device) -> None:
        """Before the first step: θ0 at the canaries' coordinates, and per-parameter index tensors."""
        parameters = dict(model.named_parameters())
        self.theta0 = self.coordinates_of(parameters)
        ids = torch.as_tensor(self.included_ids, device=device)
        for name in sorted(set(self.names)):
            mine = torch.as_tensor(np.asarray(self.names) == name, device=device)
            rows = torch.nonzero(mine[ids]).squeeze(1)  # pseudo-record slots whose canary is on `name`
            self._by_parameter[name] = (rows, torch.as_tensor(self.flat, device=device)[ids][rows])
        self._all_flat = {name: torch.as_tensor(self.flat[np.asarray(self.names) == name], device=device)
                          for name in set(self.names)}

    def coordinates_of(self, tensors: dict[str, Tensor]) -> np.ndarray:
        """The value at every canary's coordinate, in canary order."""
        out = np.empty(len(self.names))
        for name in set(self.names):
            mine = np.asarray(self.names) == name
            values = tensors[name].detach().reshape(-1)[torch.as_tensor(self.flat[mine], device=tensors[name].device)]
            out[mine] = values.cpu().double().numpy()
        return out

    def clipped_sums(self, slots: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
        """Σ over the sampled pseudo-records (`slots`: 0-based among the included canaries) of their
        clipped gradients: clip_C(magnitude·e_c) through the same clip factors as every record."""
        from dpltm.dp import ghost  # looked up at call time: the test-only faults patch it there

        out: dict[str, Tensor] = {}
        if slots.numel() == 0:
            return out
        for name, (rows, flat) in self._by_parameter.items():
            hit = torch.isin(rows, slots)
            coordinates = flat[hit]
            if coordinates.numel() == 0:
                continue
            template = like[name]
            norms = torch.full((coordinates.numel(),), self.magnitude, dtype=template.dtype, device=template.device)
            contribution = ghost.clip_factors(norms, self.clip) * norms
            total = torch.zeros(template.numel(), dtype=template.dtype, device=template.device)
            out[name] = total.index_add_(0, coordinates, contribution).view_as(template)
        return out

    def record(self, noisy_sums: dict[str, Tensor]) -> None:
        """After the noise: the released sum at every canary coordinate, in units of C."""
        values = torch.empty(len(self.names), dtype=torch.float64, device=next(iter(noisy_sums.values())).device)
        for name, flat in self._all_flat.items():
            mine = torch.as_tensor(np.asarray(self.names) == name, device=values.device)
            values[mine] = noisy_sums[name].detach().reshape(-1)[flat].double() / self.clip
        self.released.append(values)

    def scores(self, final: dict[str, Tensor], sample_rate: float, noise_multiplier: float) -> dict[str, np.ndarray]:
        """The two white-box attacks' scores (higher: more likely included)."""
        released = torch.stack(self.released).cpu().numpy() if self.released else np.zeros((0, len(self.names)))
        s2 = max(noise_multiplier, 1e-6) ** 2
        # log[(1−q)·N(z; 0, σ²) + q·N(z; 1, σ²)] − log N(z; 0, σ²), summed over the steps
        ratio = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + (2 * released - 1) / (2 * s2))
        assert self.theta0 is not None
        return {"iterates": ratio.sum(axis=0), "final_model": self.theta0 - self.coordinates_of(final)}


def _first_layer(model: torch.nn.Module, num_features: int | None) -> str | None:
    """The weight that multiplies the input records (a Linear on the raw features), if any."""
    for name, parameter in model.named_parameters():
        if name.endswith(".weight"):
            return name if parameter.dim() == 2 and parameter.shape[1] == num_features else None
    return None


@dataclass
class InputCanaries:
    """Black-box canaries: out-of-distribution records with random labels."""

    features: Tensor
    labels: Tensor
    included: np.ndarray

    @classmethod
    def draw(cls, reference: Tensor, num_classes: int, m: int, seed: int | None) -> InputCanaries:
        """Features uniform over [min, max] of `reference` (a scalar range: reveals nothing per record)."""
        generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed + 2)
        low, high = float(reference.min()), float(reference.max())
        features = low + (high - low) * torch.rand(m, reference.shape[1], generator=generator, dtype=torch.float64)
        labels = torch.randint(0, num_classes, (m,), generator=generator)
        return cls(features.to(reference.dtype).to(reference.device), labels.to(reference.device),
                   inclusion_bits(m, seed))

    def scores(self, model: torch.nn.Module) -> np.ndarray:
        """Negative cross-entropy of each canary under the released model."""
        model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(self.features), self.labels, reduction="none")
        return (-loss).double().cpu().numpy()


def describe(threat_model: str) -> dict[str, Any]:
    """What each threat model's numbers come from (for the report and the docs)."""
    return {
        "white-box": {"canary_design": "Dirac gradient canaries on surviving weights (norm 100·C before clipping)",
                      "attack_observes": "the released noisy gradient at each canary's coordinate at every step "
                                         "(iterates); also reported: the final model only"},
        "black-box": {"canary_design": "out-of-distribution input records with random labels",
                      "attack_observes": "the released model's loss on each canary"},
    }[threat_model]
