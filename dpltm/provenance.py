"""What produced a file: the versions of dpltm and of the libraries whose behaviour its numbers
depend on (torch's kernels and RNG, Lightning's loop, dp-accounting's PLD, numpy), so a result can
be traced and a surprise after an upgrade explained. Recorded in every checkpoint and run folder."""

from __future__ import annotations

import functools
import platform
import sys
from importlib import metadata

#: distributions whose versions are recorded (import names differ: dp-accounting is dp_accounting)
RECORDED = ("dpltm", "torch", "torchvision", "lightning", "torchmetrics", "numpy", "scipy", "dp-accounting")


@functools.cache
def environment() -> dict[str, str]:
    """{distribution: version} for RECORDED (missing ones as "not installed"), plus Python and the platform."""
    versions = {}
    for name in RECORDED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {**versions, "python": platform.python_version(), "platform": sys.platform}
