"""Analytic cost model: per-tensor bytes at both levels (SRAM <-> L2, L2 <-> DRAM), FLOPs, SRAM and roofline time
of each algorithm, from plain sizes.

Every function takes integers or NumPy arrays (a sweep) and returns a frozen ``Cost``; given ``hw`` (a
``simulator.hardware.HardwareSpec``) the attention functions also count the reuse the shared cache gives from the
schedule (``reuse.py``), and ``tiles=`` picks the paper's, flash-attn's or this library's tile shapes
(``tile_shapes.py``). ``Cost.time(hw)`` applies the roofline over the levels and returns a ``RooflineTime`` (a
wall-clock measurement is ``simulator.measure.Timing``); ``published.validation_rows()`` holds the model against
published GPU measurements. KV-cache sizes of whole models: ``models.kv_cache_bytes``.
"""
from .attention import (decode, flash1_forward, flash2_backward, flash2_forward, standard_backward,
                        standard_forward)
from .ledger import Cost, KernelCost, RooflineTime
from .matmul import dense, int8_split
from .tile_shapes import TILE_RULES, implemented_tiles
from .tiling import flash_sram_bytes, flash_tiles

__all__ = ["Cost", "KernelCost", "RooflineTime", "TILE_RULES", "decode", "dense", "flash1_forward", "flash2_backward",
           "flash2_forward", "flash_sram_bytes", "flash_tiles", "implemented_tiles", "int8_split",
           "standard_backward", "standard_forward"]
