"""Tile simulator: each algorithm as a schedule of tile loads, on-chip compute and stores, on a machine whose SRAM
refuses to overflow, with an optional LRU shared cache (``l2_bytes``, replayed in waves of ``concurrent`` units);
it counts the bytes per tensor at both levels and computes the real output."""
from .attention import SimResult, decode, flash1_forward, flash2_forward, standard_forward
from .machine import Event, Machine, SramOverflowError
from .matmul import Int8Weight, int8_split, quantize_weight

__all__ = ["Event", "Int8Weight", "Machine", "SimResult", "SramOverflowError", "decode", "flash1_forward",
           "flash2_forward", "int8_split", "quantize_weight", "standard_forward"]
