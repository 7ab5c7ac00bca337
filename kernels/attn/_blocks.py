"""Default flash tile sizes Br, Bc from this machine's cache, as FlashAttention sizes them from SRAM."""
from __future__ import annotations

import math

from ..cpuinfo import l2_bytes

MIN_BLOCK = 16  # below this a block matmul is dominated by call overhead
MAX_BLOCK_K = 512  # measured by hand (block sweep at N=4096, d=64): slower past 256-512 key rows on the Zen 4


def default_blocks(d: int, elem_bytes: int, group: int = 1) -> tuple[int, int]:
    """(Br, Bc) for head dim d and element size ``elem_bytes``.

    FlashAttention (Dao et al. 2022), Algorithm 1 line 1: with an on-chip memory of M elements,
    Bc = ceil(M / 4d) and Br = min(ceil(M / 4d), d). Here M is a quarter of one core's L2: the rest holds the
    output accumulators of the ``group`` query heads that share a K/V tile, and what streams through. The paper's
    Br <= d bound comes from GPU registers; a CPU core gains from a taller query block (fewer, larger BLAS calls),
    so Br = Bc here (measured on the Zen 4 machine at d=64: (256, 256) 127 GFLOP/s, (64, 256) 113 GFLOP/s).
    """
    m_elems = l2_bytes() // 4 // elem_bytes
    bc = max(MIN_BLOCK, min(math.ceil(m_elems / (4 * d)), MAX_BLOCK_K))
    br = max(MIN_BLOCK, bc // max(1, group))
    return br, bc
