"""Exact attention: a float64 oracle, FlashAttention-2 on the CPU (Numba) and the standard algorithm (NumPy)."""
from ._api import ALGORITHMS, BACKENDS, attention, flash_memory_bytes
from ._blocks import default_blocks
from ._memory import InsufficientMemoryError
from ._reference import reference

__all__ = ["ALGORITHMS", "BACKENDS", "InsufficientMemoryError", "attention", "default_blocks", "flash_memory_bytes",
           "reference"]
