"""Tile shapes as implemented: the paper's rule, flash-attn's block sizes, and this library's kernels' tiles.

``tiles="paper"``: FlashAttention's Algorithm 1 line 1 (``tiling.flash_tiles``), Br <= d — the rule of the
analysis, not what any fast kernel runs. ``tiles="flash-attn"``: the forward block sizes flash-attn 2.x picks per
head dim and architecture, restated from ``csrc/flash_attn/src/flash_fwd_launch_template.h`` (Dao-AILab/
flash-attention at commit 01afd16d248c4c7d0f9aed1914084f16c490eaed, the ``run_mha_fwd_hdim*`` functions, the
no-dropout branch). ``tiles="ioaware"``: the tiles this library's own kernels use, restated as data (the cost model
imports no kernels; ``tests/simulator/test_tile_shapes.py`` holds these values against the kernels' constants):
the CPU kernel's ``kernels/attn/_blocks.py:default_blocks``, the CuPy tier's ``kernels/attn/_cupy.py`` (BR, BC,
``flash_shared_bytes``) and the Numba-CUDA tier's ``kernels/attn/_numba_cuda.py`` (``default_tiles``,
``flash_shared_bytes``).

Each function returns (Br, Bc, shared-memory bytes of one CTA or task, threads per CTA or None).
"""
from __future__ import annotations

import math

TILE_RULES = ("paper", "flash-attn", "ioaware")

# flash-attn 2.x forward, no dropout: head dim -> (kBlockM, kBlockN, warps), and the sm8x (8.6, 8.9) exceptions
FLASH_ATTN_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
FLASH_ATTN_FWD = {32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4), 192: (128, 64, 8)}
FLASH_ATTN_FWD_SM8X = {(96, False): (128, 64, 4), (96, True): (64, 64, 4), (128, False): (128, 32, 4),
                       (128, True): (64, 64, 4)}
# hdim 256: 128 × 64 with 8 warps where a block may opt into 2·256·(128 + 2·64) bytes and an SM holds fewer than
# 4·256·(64 + 2·64) (A100: one CTA per SM either way), else 64 × 64 with 4 warps (H100: two CTAs per SM)
FLASH_ATTN_FWD_256 = ((128, 64, 8), (64, 64, 4))
# per-block opt-in shared memory (CUDA C++ Programming Guide, compute capabilities table): 8.0 163 KB, 9.0 227 KB,
# 8.6 / 8.9 99 KB
OPTIN_SMEM_PER_BLOCK = {"8.0": 163 * 1024, "8.6": 99 * 1024, "8.7": 163 * 1024, "8.9": 99 * 1024, "9.0": 227 * 1024}

# ioaware's CPU kernel (kernels/attn/_blocks.py)
CPU_MIN_BLOCK, CPU_MAX_BLOCK_K = 16, 512
# ioaware's CuPy tier (kernels/attn/_cupy.py): fixed 64 × 64 tiles, 4 warps, head dims 64 and 128, 16-bit inputs
CUPY_BR, CUPY_BC, CUPY_THREADS, CUPY_HEAD_DIMS = 64, 64, 128, (64, 128)
# ioaware's Numba-CUDA tier (kernels/attn/_numba_cuda.py): one thread per query row, static shared memory
NUMBA_CUDA_STATIC_SMEM = 48 * 1024


def flash_attn_fwd_tiles(d: int, causal: bool, hw, elem_bytes: int = 2):
    """flash-attn 2.x forward tiles for head dim d (rounded up to the kernels' 32, 64, 96, 128, 192, 256)."""
    cc = getattr(hw, "compute_capability", "")
    if hw.kind != "gpu" or not cc or float(cc) < 8.0:
        raise ValueError(f"tiles='flash-attn': flash-attn 2 runs on Ampere or newer GPUs (compute capability >= "
                         f"8.0); {hw.name} has {cc or 'no compute capability'} ({hw.kind})")
    if elem_bytes != 2:
        raise ValueError(f"tiles='flash-attn': flash-attn takes fp16/bf16 inputs (elem_bytes=2); got {elem_bytes}")
    head = next((h for h in FLASH_ATTN_HEAD_DIMS if d <= h), None)
    if head is None:
        raise ValueError(f"tiles='flash-attn': flash-attn 2 supports head dims up to 256; got d={d}")
    sm8x = cc.startswith("8.") and cc != "8.0"
    if head == 256:
        optin = OPTIN_SMEM_PER_BLOCK.get(cc, 0)
        wide = optin >= 2 * 256 * (128 + 2 * 64) and hw.sram_per_sm_bytes < 4 * 256 * (64 + 2 * 64)
        br, bc, warps = FLASH_ATTN_FWD_256[0 if wide else 1]
    else:
        br, bc, warps = FLASH_ATTN_FWD_SM8X.get((head, bool(causal)), FLASH_ATTN_FWD[head]) if sm8x \
            else FLASH_ATTN_FWD[head]
    smem = elem_bytes * (br + 2 * bc) * head  # Flash_fwd_kernel_traits::kSmemSize: sQ + sK + sV
    return br, bc, smem, 32 * warps


def ioaware_cpu_tiles(d: int, elem_bytes: int, group: int, core_l2_bytes: int):
    """The CPU flash kernel's (Br, Bc): the paper's rule with M a quarter of one core's L2, Br = Bc // group."""
    m_elems = int(core_l2_bytes) // 4 // elem_bytes
    bc = max(CPU_MIN_BLOCK, min(math.ceil(m_elems / (4 * d)), CPU_MAX_BLOCK_K))
    br = max(CPU_MIN_BLOCK, bc // max(1, group))
    rows = group * br
    task_bytes = elem_bytes * (3 * rows * d + 2 * rows * bc + 3 * rows)  # kernels/attn/_api.py flash_memory_bytes
    return br, bc, task_bytes, None


def ioaware_cupy_tiles(d: int, elem_bytes: int = 2):
    """The CuPy tier's fixed tiles and its dynamic shared memory (Q tile, two stages of K and V, rows padded)."""
    return CUPY_BR, CUPY_BC, (CUPY_BR + 4 * CUPY_BC) * (d + 8) * elem_bytes, CUPY_THREADS


def ioaware_numba_cuda_tiles(d: int, elem_bytes: int):
    """The Numba-CUDA tier's (Br, Bc): Br rows by head dim, the largest power of two Bc <= 128 that fits 48 KiB."""
    br = 64 if d <= 64 else 32 if d <= 128 else 16
    bc = 128
    while bc > 1 and (br + 2 * bc) * d * elem_bytes > NUMBA_CUDA_STATIC_SMEM:
        bc //= 2
    return br, bc, (br + 2 * bc) * d * elem_bytes, br


def ioaware_tiles(d: int, elem_bytes: int, group: int, hw):
    """The tiles of the kernel this library runs on ``hw``: the CPU kernel; on a GPU the CuPy tier where it covers
    the case (16-bit inputs, d in 64, 128), else the Numba-CUDA tier (as ``kernels.attention``'s backend='auto')."""
    if hw.kind == "cpu":
        return ioaware_cpu_tiles(d, elem_bytes, group, hw.sram_per_sm_bytes)
    if elem_bytes == 2 and d in CUPY_HEAD_DIMS:
        return ioaware_cupy_tiles(d, elem_bytes)
    return ioaware_numba_cuda_tiles(d, elem_bytes)


def implemented_tiles(tiles: str, d, elem_bytes, group, hw, causal=False):
    """(Br, Bc, CTA bytes, threads) of ``tiles`` = 'flash-attn' or 'ioaware' for scalar sizes (the rules branch on
    the head dim, so a sweep calls this per configuration)."""
    if tiles not in TILE_RULES:
        raise ValueError(f"unknown tiles {tiles!r}; known: {', '.join(TILE_RULES)}")
    if hw is None:
        raise ValueError(f"tiles={tiles!r} depends on the machine: give hw (a HardwareSpec)")
    for name, value in (("d", d), ("elem_bytes", elem_bytes), ("group", group), ("causal", causal)):
        if getattr(value, "ndim", 0):
            raise ValueError(f"tiles={tiles!r} takes scalar sizes; got an array for {name}")
    d, elem_bytes, group = int(d), int(elem_bytes), int(group)
    if tiles == "flash-attn":
        return flash_attn_fwd_tiles(d, bool(causal), hw, elem_bytes)
    return ioaware_tiles(d, elem_bytes, group, hw)
