"""Analytic cost model: per-tensor HBM bytes, FLOPs, SRAM and roofline time of each algorithm, from plain sizes.

Every function takes integers or NumPy arrays (a sweep) and returns a frozen ``Cost``; ``Cost.time(hw)`` applies
the roofline of a ``simulator.hardware.HardwareSpec`` and returns a ``RooflineTime`` (a wall-clock measurement is
``simulator.measure.Timing``). KV-cache sizes of whole models: ``models.kv_cache_bytes``.
"""
from .attention import (decode, flash1_forward, flash2_backward, flash2_forward, standard_backward,
                        standard_forward)
from .ledger import Cost, KernelCost, RooflineTime
from .matmul import dense, int8_split
from .tiling import flash_sram_bytes, flash_tiles

__all__ = ["Cost", "KernelCost", "RooflineTime", "decode", "dense", "flash1_forward", "flash2_backward",
           "flash2_forward", "flash_sram_bytes", "flash_tiles", "int8_split", "standard_backward",
           "standard_forward"]
