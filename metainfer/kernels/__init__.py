"""Triton kernels, their PyTorch references, and the dispatch the model calls (`ops`)."""
