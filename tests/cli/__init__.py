"""The CLI (dpltm.cli) and end-to-end commands."""
