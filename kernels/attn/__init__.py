"""Exact attention: a float64 oracle, FlashAttention-2 on the CPU (Numba) and the standard algorithm (NumPy)."""
from ._api import ALGORITHMS, BACKENDS, attention
from ._blocks import default_blocks
from ._memory import InsufficientMemoryError
from ._reference import TOLERANCES, plain_attention, reference, round_to, within_tolerance

__all__ = ["ALGORITHMS", "BACKENDS", "InsufficientMemoryError", "TOLERANCES", "attention", "default_blocks", "plain_attention",
           "reference", "round_to", "within_tolerance"]
