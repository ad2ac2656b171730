"""benchmarks/grid: the experiment grid and its report."""
