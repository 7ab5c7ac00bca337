"""Traffic at both levels and FLOPs of matmuls: dense, and the LLM.int8() split matmul (Dettmers et al. 2022)."""
from __future__ import annotations

import numpy as np

from .ledger import Cost, kernel
from .sizes import check_product, check_sizes
from .tiling import STAT_BYTES, cdiv

# Output-stationary GEMM tiles (a Bm × Bn output tile accumulates in float32 while Bk-deep panels stream): the
# common CUTLASS-style threadblock shape 128 × 128 × 32.
GEMM_TILE = (128, 128, 32)
# DRAM reuse of a tiled GEMM. Every tile load crosses SRAM <-> L2 (X is loaded once per column block of Y, W once
# per row block: the ledger's ``reads``, what the tile simulator executes). "ideal": the re-reads hit the L2 cache
# (a rasterized tile order keeps the panels there), so X and W each cross DRAM once: the usual roofline
# assumption for GEMM, and the default. "tiled": every tile load also comes from DRAM, an upper bound.
REUSE = ("ideal", "tiled")


def _check_tile(tile):
    """A (Bm, Bn, Bk) tile of whole numbers >= 1 (``tile=0`` was a TypeError from indexing it)."""
    if not isinstance(tile, (tuple, list)) or len(tile) != 3:
        raise ValueError(f"tile must be a (Bm, Bn, Bk) tuple; got {tile!r}")
    bm, bn, bk = check_sizes(Bm=tile[0], Bn=tile[1], Bk=tile[2])
    return int(bm), int(bn), int(bk)


def _reuse_factors(m, n, tile, reuse):
    if reuse not in REUSE:
        raise ValueError(f"unknown reuse {reuse!r}; known: {', '.join(REUSE)}")
    bm, bn = np.minimum(tile[0], m), np.minimum(tile[1], n)
    if reuse == "ideal":
        return 1, 1, bm, bn
    return cdiv(n, bn), cdiv(m, bm), bm, bn


def _gemm_traffic(m, k, n, x_bytes, w_bytes, tile, reuse):
    """(X tile loads, W tile loads, X DRAM reads, W DRAM reads, SRAM working set) of one tiled GEMM."""
    x_times, w_times, bm, bn = _reuse_factors(m, n, tile, "tiled")
    bk = np.minimum(tile[2], k)
    x_loads = m * k * x_bytes * x_times  # each output column block loads all of X
    w_loads = k * n * w_bytes * w_times  # each output row block loads all of W
    x_dram, w_dram = (x_loads, w_loads) if reuse == "tiled" else (m * k * x_bytes, k * n * w_bytes)
    sram = x_bytes * bm * bk + w_bytes * bk * bn + STAT_BYTES * bm * bn
    return x_loads, w_loads, x_dram, w_dram, sram


def dense(m, k, n, *, elem_bytes=2, out_bytes=None, flop_kind="fp16", tile=GEMM_TILE, reuse="ideal") -> Cost:
    """Y (m × n) = X (m × k) · W (k × n) over ``tile``-shaped tiles, with ``reuse`` as described at ``REUSE``.
    With m = 1 (a decode GEMV) W is read exactly once either way: the memory-bound case."""
    m, k, n, elem_bytes = check_sizes(m=m, k=k, n=n, elem_bytes=elem_bytes)
    out_bytes = elem_bytes if out_bytes is None else check_sizes(out_bytes=out_bytes)[0]
    check_product("m·k·n·elem_bytes·4", m, k, n, np.maximum(elem_bytes, out_bytes), 4)
    tile = _check_tile(tile)
    _reuse_factors(m, n, tile, reuse)  # checks reuse
    x_loads, w_loads, x_dram, w_dram, sram = _gemm_traffic(m, k, n, elem_bytes, elem_bytes, tile, reuse)
    kern = kernel("gemm", reads={"X": x_loads, "W": w_loads}, writes={"Y": m * n * out_bytes},
                  flops=2 * m * k * n, flop_kind=flop_kind, sram_peak_bytes=sram,
                  dram_reads={"X": x_dram, "W": w_dram})
    return Cost("dense", (kern,), 2 * m * k * n)


def int8_split(m, k, n, n_outliers, *, elem_bytes=2, out_bytes=None, tile=GEMM_TILE, reuse="ideal") -> Cost:
    """LLM.int8() matmul with mixed-precision decomposition (Dettmers et al. 2022, §3.2, eq. 7).

    1. ``outlier_detect``: a pass over X marks the columns where any |x| >= threshold (one flag byte each).
    2. ``quantize``: a second pass quantizes the other columns row-wise (vector-wise absmax): reads X and the
       flags, writes X_i8 (1 B/element), the row scales (float32) and the outlier columns X_o.
    3. ``int8_gemm``: X_i8 · W_i8 with int32 accumulation over 128 × 128 × 32 tiles; each output tile's epilogue
       reads its row and column scales and dequantizes (C·s_x ⊗ s_w / 127²) into Y. Tile loads at SRAM <-> L2
       always count the re-reads; DRAM's as ``REUSE``.
    4. ``outlier_gemm``: X_o · W_o for the ``n_outliers`` columns in fp16, W_o dequantized on the fly from the
       int8 rows and column scales (the weights are stored only in int8), added into Y (read, write).
    The weight is stored as int8 plus one float32 scale per output column: 4x fewer bytes than float32.
    Where the paper is silent: detection is its own pass (the flags must be known before any row is quantized),
    and the int8 weights were quantized once, offline, so that is not counted here.
    """
    m, k, n, elem_bytes = check_sizes(m=m, k=k, n=n, elem_bytes=elem_bytes)
    n_out, = check_sizes(minimum=0, n_outliers=n_outliers)
    if np.any(n_out > k):
        raise ValueError(f"n_outliers must be <= k (outlier dimensions are hidden dimensions); got {n_outliers} "
                         f"for k={k}")
    out_bytes = elem_bytes if out_bytes is None else check_sizes(out_bytes=out_bytes)[0]
    check_product("m·k·n·elem_bytes·4", m, k, n, np.maximum(elem_bytes, out_bytes), 4)
    k_in = k - n_out  # the regular (non-outlier) hidden dimensions
    tile = _check_tile(tile)
    x_times, w_times, bm, bn = _reuse_factors(m, n, tile, "tiled")
    _reuse_factors(m, n, tile, reuse)  # checks reuse
    scale_x_reads = m * STAT_BYTES * x_times  # each output tile's epilogue reads its rows' scales
    scale_w_reads = n * STAT_BYTES * w_times  # ... and its columns' scales
    scale_x_dram, scale_w_dram = ((scale_x_reads, scale_w_reads) if reuse == "tiled"
                                  else (m * STAT_BYTES, n * STAT_BYTES))
    x_reads, w_reads, x_dram, w_dram, sram = _gemm_traffic(m, k_in, n, 1, 1, tile, reuse)
    xo_reads, wo_reads, xo_dram, wo_dram, sram_o = _gemm_traffic(m, np.maximum(n_out, 1), n, elem_bytes, 1, tile,
                                                                 reuse)
    has = n_out > 0
    kernels = (
        kernel("outlier_detect", reads={"X": m * k * elem_bytes}, writes={"outlier_cols": k}, flops=0,
               flop_kind="fp32", sram_peak_bytes=k * elem_bytes),
        kernel("quantize", reads={"X": m * k * elem_bytes, "outlier_cols": k},
               writes={"X_i8": m * k_in, "scale_x": m * STAT_BYTES, "X_o": m * n_out * elem_bytes},
               flops=0, flop_kind="fp32", sram_peak_bytes=k * (elem_bytes + 1)),
        kernel("int8_gemm", reads={"X_i8": x_reads, "W_i8": w_reads, "scale_x": scale_x_reads,
                                   "scale_w": scale_w_reads},
               writes={"Y": m * n * out_bytes}, flops=2 * m * k_in * n, flop_kind="int8",
               sram_peak_bytes=sram + STAT_BYTES * (bm + bn),
               dram_reads={"X_i8": x_dram, "W_i8": w_dram, "scale_x": scale_x_dram, "scale_w": scale_w_dram}),
        kernel("outlier_gemm",
               reads={"X_o": np.where(has, xo_reads, 0), "W_i8": np.where(has, wo_reads, 0),
                      "scale_w": np.where(has, scale_w_reads, 0), "Y": np.where(has, m * n * out_bytes, 0)},
               writes={"Y": np.where(has, m * n * out_bytes, 0)},
               flops=2 * m * n_out * n, flop_kind="fp16",
               sram_peak_bytes=np.where(has, sram_o + STAT_BYTES * bn + out_bytes * bm * bn, 0),
               dram_reads={"X_o": np.where(has, xo_dram, 0), "W_i8": np.where(has, wo_dram, 0),
                           "scale_w": np.where(has, scale_w_dram, 0), "Y": np.where(has, m * n * out_bytes, 0)}),
    )
    return Cost("int8_split", kernels, 2 * m * k * n)
