"""Phase 2, the choice of a winner: selection rules (exponential mechanism, best, noise-aware) and the winner file."""
