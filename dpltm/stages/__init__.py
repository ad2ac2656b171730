"""The three stages as the CLI runs them: generate (phase 1), select (phase 2), train (phase 3).

Each module resolves its settings, checks its inputs and outputs before any work, runs the
library code (`dpltm.tickets`, `dpltm.selection`, `dpltm.training`) and
reports on stderr. `dpltm.cli` only parses options and prints the final reports.
"""
