"""Exact attention: a float64 oracle, FlashAttention-2 on the CPU (Numba) and the standard algorithm (NumPy)."""
from ._api import ALGORITHMS, BACKENDS, attention
from ._blocks import default_blocks
from ._reference import reference

__all__ = ["ALGORITHMS", "BACKENDS", "attention", "default_blocks", "reference"]
