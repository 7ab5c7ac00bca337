"""Exact attention: a float64 oracle, FlashAttention-2 and the standard algorithm on the CPU (Numba, NumPy) and on
the GPU (Numba-CUDA, and CUDA C on tensor cores through CuPy, where bfloat16 runs as well)."""
from ._api import ALGORITHMS, BACKENDS, attention, attention_bfloat16, flash_memory_bytes, standard_phase_times
from ._blocks import default_blocks
from ._cupy import from_bfloat16_bits, to_bfloat16_bits
from ._reference import plain_attention, reference, round_to, within_tolerance
from ._standard import PHASES as STANDARD_PHASES

__all__ = ["ALGORITHMS", "BACKENDS", "attention", "attention_bfloat16", "default_blocks", "flash_memory_bytes",
           "from_bfloat16_bits", "plain_attention", "reference", "round_to", "STANDARD_PHASES",
           "standard_phase_times", "to_bfloat16_bits", "within_tolerance"]
