"""Canaries and the attacks that score them (Steinke, Nasr & Jagielski 2023; Nasr et al. 2023).

Each of m canaries is included in training independently with probability 1/2 (a fresh OS-CSPRNG
draw unless seeded; the attack never sees the draw). The run samples from a fixed universe of
N + m records, every one with probability q = L/(N + m), and an excluded canary's slot simply
contributes nothing: the sampling rate, the step count and σ are those of a dataset of N + m
records whatever the inclusion bits are, so the mechanism and its claimed ε do not depend on them
(the theorem's setting). Two threat models:

- **white-box gradient canaries**: canary i is a record whose gradient is a Dirac on one surviving
  weight c_i, of norm `magnitude` ≫ C (Nasr et al.'s "Dirac canary"); its clip factor comes from
  the same function as every record's (`ghost.clip_factors`), and the clipped gradient joins the
  clipped sum before the noise. The attack observes the released noisy gradients at c_i
  (`iterates`: what the DP-SGD iterates reveal; a likelihood-ratio score of the mixture
  (1−q)·N(0, σ²) + q·N(1, σ²) against N(0, σ²), in units of C) or only the final model
  (`final_model`: how far θ[c_i] moved against the canary's gradient).
- **black-box input canaries**: out-of-distribution records (features uniform over the data's
  range, random labels) in the training set, through the whole per-record path; the attack scores
  each by its negative loss on the released model.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpltm.choices import ThreatModel
from dpltm.errors import DpltmUserError

THREAT_MODELS = tuple(choice.value for choice in ThreatModel)
#: ‖canary gradient‖ / C before clipping: with clipping on it is cut to C; a broken clip lets it through.
CANARY_MAGNITUDE_OVER_CLIP = 100.0


def seed_streams(seed: int | None) -> list[np.random.SeedSequence]:
    """Independent streams for the inclusion bits, the coordinates and the input canaries: one
    seed never correlates two of them (nor the ranking's tie-breaks, seeded elsewhere)."""
    root = np.random.SeedSequence(secrets.randbits(128) if seed is None else seed)
    return root.spawn(3)


def inclusion_bits(m: int, seed: int | None) -> np.ndarray:
    """m independent fair coins: which canaries go into training (secret from the attack)."""
    return np.random.default_rng(seed_streams(seed)[0]).random(m) < 0.5


@dataclass
class GradientCanaries:
    """White-box canaries: one surviving weight each; slots N … N+m−1 of the sampled universe."""

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
    """parameter → (its canaries' ids, their flat coordinates), on the device"""
    _included: Tensor | None = None

    @property
    def extra_records(self) -> int:
        return len(self.names)

    @classmethod
    def draw(cls, model: torch.nn.Module, surviving: dict[str, Tensor | None], m: int, clip: float,
             seed: int | None, features: Tensor | None = None) -> GradientCanaries:
        """m distinct surviving weights (never biases) and the inclusion bits.

        Quiet coordinates first: first-layer weights on an input feature that is 0 in every
        training record (MNIST's border pixels) get no gradient from the data, so a canary there
        competes with the noise alone, as in Nasr et al.'s white-box audit; the rest are drawn
        uniformly from the other surviving weights. (Choosing by the data is allowed: the bound
        needs the canaries independent of their inclusion bits only.)"""
        rng = np.random.default_rng(seed_streams(seed)[1])
        quiet: list[tuple[str, int]] = []
        loud: list[tuple[str, int]] = []
        first = _first_layer(model, None if features is None else features.shape[1])
        for name, parameter in model.named_parameters():
            if not name.endswith(".weight"):
                continue
            if name not in surviving:  # never guess: a pruned coordinate gets no noise
                raise RuntimeError(f"the mask layout does not know parameter {name}")
            indices = surviving[name]
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

    def start(self, model: torch.nn.Module, device: torch.device) -> None:
        """Before the first step: θ0 at the canaries' coordinates, and the index tensors."""
        self.theta0 = self.coordinates_of(dict(model.named_parameters()))
        names = np.asarray(self.names)
        for name in sorted(set(self.names)):
            ids = np.flatnonzero(names == name)
            self._by_parameter[name] = (torch.as_tensor(ids, device=device),
                                        torch.as_tensor(self.flat[ids], device=device))
        self._included = torch.as_tensor(self.included, device=device)

    def split(self, index: Tensor, rows: int, parameters: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """A sampled batch of the universe: its data rows (< `rows`), and the clipped gradient sum of
        its included canaries (slots ≥ `rows`; an excluded canary's slot contributes nothing)."""
        slots = index[index >= rows] - rows
        assert self._included is not None
        slots = slots[self._included[slots]]
        return index[index < rows], self._clipped_sums(slots, parameters)

    def _clipped_sums(self, slots: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
        """Σ over sampled included canaries of clip_C(magnitude·e_c), by the records' clip factors."""
        from dpltm.dp import ghost  # looked up at call time: the test-only faults patch it there

        out: dict[str, Tensor] = {}
        if slots.numel() == 0:
            return out
        for name, (ids, flat) in self._by_parameter.items():
            coordinates = flat[torch.isin(ids, slots)]
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
        device = next(iter(noisy_sums.values())).device
        values = torch.empty(len(self.names), dtype=torch.float64, device=device)
        for name, (ids, flat) in self._by_parameter.items():
            values[ids] = noisy_sums[name].detach().reshape(-1)[flat].double() / self.clip
        self.released.append(values)

    def coordinates_of(self, tensors: dict[str, Tensor]) -> np.ndarray:
        """The value at every canary's coordinate, in canary order."""
        out = np.empty(len(self.names))
        names = np.asarray(self.names)
        for name in set(self.names):
            mine = names == name
            values = tensors[name].detach().reshape(-1)[torch.as_tensor(self.flat[mine], device=tensors[name].device)]
            out[mine] = values.cpu().double().numpy()
        return out

    def scores(self, final: dict[str, Tensor], sample_rate: float, noise_multiplier: float) -> dict[str, np.ndarray]:
        """The two white-box attacks' scores (higher: more likely included)."""
        released = torch.stack(self.released).cpu().numpy() if self.released else np.zeros((0, len(self.names)))
        s2 = max(noise_multiplier, 1e-6) ** 2
        # log[(1−q)·N(z; 0, σ²) + q·N(z; 1, σ²)] − log N(z; 0, σ²), summed over the steps
        ratio = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + (2 * released - 1) / (2 * s2))
        assert self.theta0 is not None
        return {"iterates": ratio.sum(axis=0), "final_model": self.theta0 - self.coordinates_of(final)}


@dataclass
class InputCanaries:
    """Black-box canaries: out-of-distribution records with random labels, rows N … N+m−1 of the
    training set; an excluded canary's row is dropped from every batch that samples it."""

    features: Tensor
    labels: Tensor
    included: np.ndarray
    _excluded: Tensor | None = None

    extra_records = 0  # they are rows of the training set itself

    @classmethod
    def draw(cls, reference: Tensor, num_classes: int, m: int, seed: int | None) -> InputCanaries:
        """Features uniform over [min, max] of `reference` (a scalar range: reveals nothing per record)."""
        generator = torch.Generator().manual_seed(int(seed_streams(seed)[2].generate_state(1)[0]))
        low, high = float(reference.min()), float(reference.max())
        features = low + (high - low) * torch.rand(m, reference.shape[1], generator=generator, dtype=torch.float64)
        labels = torch.randint(0, num_classes, (m,), generator=generator)
        return cls(features.to(reference.dtype).to(reference.device), labels.to(reference.device),
                   inclusion_bits(m, seed))

    def start(self, model: torch.nn.Module, device: torch.device) -> None:
        self._excluded = torch.as_tensor(~self.included, device=device)

    def split(self, index: Tensor, rows: int, parameters: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        first = rows - len(self.included)  # the canaries are the training set's last m rows
        is_canary = index >= first
        dropped = torch.zeros_like(is_canary)
        assert self._excluded is not None
        dropped[is_canary] = self._excluded[index[is_canary] - first]
        return index[~dropped], {}

    def record(self, noisy_sums: dict[str, Tensor]) -> None:
        """The black-box attack sees only the final model."""

    def scores(self, model: torch.nn.Module) -> np.ndarray:
        """Negative cross-entropy of each canary under the released model."""
        model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(self.features), self.labels, reduction="none")
        return (-loss).double().cpu().numpy()


def _first_layer(model: torch.nn.Module, num_features: int | None) -> str | None:
    """The weight that multiplies the input records (a Linear on the raw features), if any."""
    for name, parameter in model.named_parameters():
        if name.endswith(".weight"):
            return name if parameter.dim() == 2 and parameter.shape[1] == num_features else None
    return None


def describe(threat_model: str) -> dict[str, Any]:
    """What each threat model's numbers come from (for the report and the docs)."""
    return {
        "white-box": {"canary_design": "Dirac gradient canaries on surviving weights (norm 100·C before clipping)",
                      "attack_observes": "the released noisy gradient at each canary's coordinate at every step "
                                         "(iterates); also reported: the final model only"},
        "black-box": {"canary_design": "out-of-distribution input records with random labels",
                      "attack_observes": "the released model's loss on each canary"},
    }[threat_model]
