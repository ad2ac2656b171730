"""dpltm.privacy: accounting, ledger, displayed figures."""
