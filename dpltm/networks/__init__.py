"""Networks of their own files, one module each, named by an `ArchitectureEntry.module` in
dpltm/architectures.py. Each module's `build(arch, generator)` returns a plain `nn.Module` whose
prunable weights (linear and convolution weights) a ticket may mask; dpltm trains it through the DP
engine's per-layer rules (dpltm.dp.engine), so its layers need nothing else from dpltm."""
