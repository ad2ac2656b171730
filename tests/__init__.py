"""The test suite: one folder per wing of the package (tests/dp ↔ dpltm/dp, ...); cross-cutting checks at the top."""
