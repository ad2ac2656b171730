"""Phase 1, the tickets: iterative magnitude pruning on public data (`imp`) and private tickets
made on the private data by DP warm-up (`private`)."""
