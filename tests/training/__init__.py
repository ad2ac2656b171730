"""dpltm.training: plain, private and transfer training."""
