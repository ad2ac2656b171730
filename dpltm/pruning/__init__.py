"""Pruning: pure functions from (weights, mask) to a new mask."""

from dpltm.pruning.magnitude import paper_prune_rates, prune_layerwise, pruned_count, random_masks_like

__all__ = ["paper_prune_rates", "prune_layerwise", "pruned_count", "random_masks_like"]
