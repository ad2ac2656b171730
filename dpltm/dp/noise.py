"""The noise mechanisms dpltm offers and what each can do: the one registry every front end reads.

Adding a noise mechanism: one module with a class satisfying `NoiseMechanism` and built by
`build(parameter, context)` (dpltm/dp/mechanism.py; like dpltm/dp/gaussian.py) and one `NoisePlugin`
line below. The CLI's `--noise` choices, the ledger's vocabulary and statements, the σ ↔ effective
multiplier maps the planners and accountants use, and every capability check (public data needed,
convolutions supported, plain clipping norm) are derived from this table; the shared suite in
tests/dp/test_noise_plugins.py runs every entry. This module imports nothing heavy (no torch), so
`dpltm --help` stays quick; a mechanism's class is imported when it is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dpltm.errors import DpltmUserError


@dataclass(frozen=True)
class NoisePlugin:
    name: str
    target: str
    """`module:Class` of the mechanism, imported on first use."""
    statement: str
    """How a privacy statement names it (dpltm.privacy.ledger)."""
    needs_public_data: bool = False
    """Its noise is shaped from public data (`--public-dataset`): runs without it are refused."""
    plain_norm: bool = True
    """It clips in the plain L2 norm and adds isotropic noise with an effective multiplier, so the
    noise-aware choice can simulate it and the audit's canaries measure it."""
    convolutions: bool = True
    """It supports the convolutional layers of `--arch lenet5` (a noise geometry on the MLP's layers
    only does not)."""
    per_parameter: float = 1.0
    """Noise std per unit of the plug-in's own σ, in units of the clip C: its effective multiplier, what
    the accountant sees, is per_parameter·σ (docs/privacy.md §4 for dpd's 2σ)."""

    def effective_for(self, parameter: float) -> float:
        """The effective Gaussian multiplier (noise std / add-remove sensitivity) of parameter σ."""
        return self.per_parameter * parameter

    def parameter_for(self, effective: float) -> float:
        """The plug-in's σ that gives the effective multiplier `effective`."""
        return effective / self.per_parameter

    def load(self) -> Any:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


NOISE_PLUGINS: dict[str, NoisePlugin] = {plugin.name: plugin for plugin in (
    NoisePlugin("gaussian", "dpltm.dp.gaussian:GaussianNoise", "Gaussian noise"),
    NoisePlugin("dpd", "dpltm.dp.dpd:DropoutNoise",
                "differentially private dropout noise (Ermiş & Cemgil; effective multiplier = 2 × its σ)",
                convolutions=False, per_parameter=2.0),
    NoisePlugin("shaped", "dpltm.dp.shaped:ShapedNoise",
                "sensitivity-shaped noise (scales from public data, clipping in the rescaled norm)",
                needs_public_data=True, plain_norm=False, convolutions=False),
)}


def check_noise_for_network(name: str, is_mlp: bool, network: str = "a convolutional network") -> None:
    """The MLP-only noise geometries (dpd, shaped) refused for any other network, in one line naming the
    plug-ins that network takes."""
    if not is_mlp and not noise_plugin(name).convolutions:
        able = ", ".join(n for n, p in NOISE_PLUGINS.items() if p.convolutions)
        raise DpltmUserError(f"--noise {name} shapes the MLP's layers; {network} trains with --noise {able}")


def noise_plugin(name: str) -> NoisePlugin:
    """The plug-in called `name`; an unknown name is one line listing the others."""
    try:
        return NOISE_PLUGINS[name]
    except KeyError:
        raise DpltmUserError(f"unknown noise '{name}' (choose from {', '.join(NOISE_PLUGINS)})") from None


def make_noise(name: str, parameter: float, context: Any = None) -> Any:
    """The `NoiseMechanism` called `name` with its own parameter σ, built from a `NoiseContext` (or None)."""
    if parameter < 0:
        raise DpltmUserError(f"noise parameter must be ≥ 0, got {parameter}")
    return noise_plugin(name).load().build(parameter, context)
