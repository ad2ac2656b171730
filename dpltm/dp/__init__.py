"""DP-SGD on a masked network: Poisson sampling, masked per-sample clipping, noise plug-ins."""

# Load the noise module (and with it the registered plug-ins) before any single plug-in
# module: the plug-ins import helpers from it, and it imports them to register them.
from dpltm.dp import noise as noise  # noqa: E402,F401
