"""dpltm.stages: what the stages write (exports, predictions, run folders, released files)."""
