"""The registry of noise plug-ins: how the clipped-gradient sum is perturbed, and how that is accounted.

Adding a mechanism: one module with a class satisfying `NoiseMechanism` (dpltm/dp/mechanism.py;
like `dpltm/dp/gaussian.py`, `dpltm/dp/dpd.py`, `dpltm/dp/shaped.py`), and one line in
dpltm/dp/plugins.py (the torch-free table of names and capabilities). Every registered plug-in runs
through the shared suite in tests/dp/test_noise_plugins.py.
"""

from __future__ import annotations

from typing import Any

from dpltm.dp.dpd import DropoutNoise
from dpltm.dp.gaussian import GaussianNoise
from dpltm.dp.mechanism import (
    NoiseContext,
    NoiseMechanism,
    ScaledGaussianNoise,
    add_gaussian,
    add_gaussian_all,
    dp_event_of,
)
from dpltm.dp.plugins import NOISE_PLUGINS, noise_plugin
from dpltm.dp.shaped import ShapedNoise
from dpltm.errors import DpltmUserError

__all__ = ["NOISE_MECHANISMS", "DropoutNoise", "GaussianNoise", "NoiseContext", "NoiseMechanism",
           "ScaledGaussianNoise", "ShapedNoise", "add_gaussian", "add_gaussian_all", "dp_event_of", "make_noise",
           "noise_class"]

NOISE_MECHANISMS: dict[str, Any] = {name: plugin.load() for name, plugin in NOISE_PLUGINS.items()}
"""name → class with `build(parameter, context)`, and the pure maps between its parameter and
the effective multiplier: `effective_for(parameter)`, `parameter_for(effective)`."""


def noise_class(name: str) -> Any:
    return NOISE_MECHANISMS[noise_plugin(name).name]


def make_noise(name: str, parameter: float, context: NoiseContext | None = None) -> NoiseMechanism:
    if parameter < 0:
        raise DpltmUserError(f"noise parameter must be ≥ 0, got {parameter}")
    return noise_class(name).build(parameter, context)  # type: ignore[no-any-return]
