"""dpltm.dp: the DP-SGD engine (clipping, noise, sampling, steps)."""
