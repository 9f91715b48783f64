"""Triton kernels and their launchers (no autograd, no nn)."""
