"""DP-SGD on a masked network: Poisson sampling, masked per-sample clipping, noise plug-ins."""
