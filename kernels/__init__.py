"""Triton kernels, each beside its plain-torch reference (naive.py)."""
