"""dpltm.pruning."""
