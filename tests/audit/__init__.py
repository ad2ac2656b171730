"""dpltm.audit: the empirical privacy audit."""
