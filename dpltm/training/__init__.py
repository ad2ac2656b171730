"""Phase 3, training a ticket: DP-SGD on the masked winner (`private`), the non-private loop
(`plain`), the stages as library calls (`pipeline`), and a ticket moved across datasets
(`transfer`)."""
