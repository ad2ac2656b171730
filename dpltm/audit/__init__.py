"""Empirical privacy auditing: a lower bound on ε from canaries in one training run.

`bounds` holds the statistics (pure functions), `canaries` the canaries and the attacks' scores,
`run` the audit itself (DP training through dpltm's own training path, with canaries added), and
`faults` test-only switches that break the mechanism so the tests can show the audit notices.
"""
