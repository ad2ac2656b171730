"""dpltm: differentially private training of neural networks by way of lottery tickets."""

__version__ = "0.1.0"
