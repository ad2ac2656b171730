"""dpltm.tickets: lottery tickets (IMP) and private tickets."""
