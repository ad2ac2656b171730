"""dpltm.api and the Lightning callback (dpltm.lightning)."""
