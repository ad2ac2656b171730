"""dpltm.selection: choosing the winning ticket."""
