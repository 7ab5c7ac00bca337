"""Attention on tensor cores, the CUDA C tier (``flash_attention.cu``, loaded with CuPy's RawModule).

- ``flash_forward``: FlashAttention-2's forward with mma.sync m16n8k16 (float16 or bfloat16 in, float32
  accumulation), ldmatrix fragment loads and cp.async double buffering of the K/V tiles; head dims 64 and 128
  (other head dims go to the Numba-CUDA tier, ``kernels/attn/_numba_cuda.py``), causal, GQA, any N and B·Hq (up to
  2^31 − 1 query tiles in all). With too few query tiles to fill the device (decode), the keys are split
  (Flash-Decoding) and ``flash_combine`` merges the splits.
- ``standard_forward``: the baseline the speedups are measured against — S = Q Kᵀ by CuPy's matmul (cuBLAS),
  the softmax kernel of ``flash_attention.cu`` over S in global memory, O = P V by CuPy's matmul.

bfloat16 has no NumPy or CuPy dtype: bfloat16 tensors travel as uint16 CuPy arrays of their bit patterns
(``to_bfloat16_bits`` / ``from_bfloat16_bits`` convert), with ``dtype="bfloat16"``.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from .._common import cuda_c as _cupy, gpu as _gpu
from ._nonfinite import restore_nonfinite_v

SOURCE = Path(__file__).with_name("flash_attention.cu")
HEAD_DIMS = (64, 128)  # the head dims the tensor-core kernel is built for
BR, BC = 64, 64  # query rows per block (4 warps × 16) and keys per K/V tile
SOFTMAX_THREADS = 256
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
COMBINE_THREADS = 256
# Flash-Decoding: split the keys until there are SPLIT_WAVES blocks per multiprocessor, at most MAX_SPLITS splits
# and at least SPLIT_MIN_TILES key tiles each (fewer would cost more in the combine than the split gains)
SPLIT_WAVES, MAX_SPLITS, SPLIT_MIN_TILES = 2, 64, 2
NAMES = (tuple(f"ioaware::flash_forward<{c}, {d}, {BR}, {BC}>" for c in CTYPES.values() for d in HEAD_DIMS)
         + tuple(f"ioaware::flash_combine<{c}, {d}>" for c in CTYPES.values() for d in HEAD_DIMS)
         + tuple(f"ioaware::softmax_rows<{c}, {SOFTMAX_THREADS}>" for c in CTYPES.values()))


def supported(dtype: str, d: int) -> bool:
    """Whether the tensor-core kernel covers this dtype and head dim."""
    return dtype in CTYPES and d in HEAD_DIMS


def flash_shared_bytes(d: int, elem_bytes: int = 2) -> int:
    """Dynamic shared memory of one block: the Q tile and two stages of K and V tiles, rows padded by 16 bytes."""
    row = (d + 8) * elem_bytes
    return (BR + 4 * BC) * row


def split_count(blocks: int, key_tiles: int, sm_count: int) -> int:
    """Splits of the keys so that ``blocks`` (B·Hq·Tr) blocks fill SPLIT_WAVES waves of the device's
    multiprocessors, each split keeping SPLIT_MIN_TILES tiles or more; 1 when the queries fill it alone."""
    want = math.ceil(SPLIT_WAVES * sm_count / max(blocks, 1))
    return max(1, min(want, MAX_SPLITS, key_tiles // SPLIT_MIN_TILES))


@functools.lru_cache(maxsize=None)
def _flash_kernel(dtype: str, d: int, device: int):
    """The flash kernel of (dtype, d), its dynamic shared-memory limit raised once per device (not per call)."""
    shared_bytes = flash_shared_bytes(d)
    _cupy.check_optin_shared_memory(shared_bytes, f"flash attention tiles Br={BR}, Bc={BC}, d={d}")
    kernel = _cupy.kernel(SOURCE, f"ioaware::flash_forward<{CTYPES[dtype]}, {d}, {BR}, {BC}>", NAMES)
    kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel, shared_bytes


def _with_nonfinite_v(forward, q, k, v, scale, causal, dtype, **options):
    """``forward`` (flash_forward or standard_forward), with the non-finite values of v put back by
    ``restore_nonfinite_v`` where a leak is possible: causal with more than one query row (without the mask every
    row sees every key; one query row, as in decode, sees them all). The check costs a pass over o (B·Hq·Nq·d
    elements, which the kernel has just written) and a wait for its answer; only where o holds a non-finite value,
    a pass over v and a second run. Not yet timed on a GPU."""
    cupy = _cupy.require_cupy()
    o, lse = forward(q, k, v, scale, causal, dtype, **options)
    if not causal or q.shape[2] < 2 or o.size == 0 or bool(_finite(o, dtype).all()):
        return o, lse
    finite = _finite(v, dtype)
    if bool(finite.all()):
        return o, lse
    o, lse = forward(q, k, cupy.where(finite, v, cupy.zeros((), dtype=v.dtype)), scale, causal, dtype, **options)
    o_float = restore_nonfinite_v(cupy, _as_float(o, dtype), _as_float(v, dtype), causal)
    return (to_bfloat16_bits(o_float) if dtype == "bfloat16" else o_float.astype(o.dtype)), lse


BFLOAT16_EXPONENT = 0x7F80  # bfloat16's 8 exponent bits, all ones for ±inf and NaN (IEEE 754 binary32's top half)


def _finite(x, dtype):
    """Elementwise: x is finite, for a float16 CuPy array or the uint16 bits of a bfloat16 one (no float copy)."""
    if dtype == "bfloat16":
        return (x & BFLOAT16_EXPONENT) != BFLOAT16_EXPONENT
    return _cupy.require_cupy().isfinite(x)


def _as_float(x, dtype):
    """A float16 CuPy array, or the uint16 bits of bfloat16 ones, as float32."""
    return from_bfloat16_bits(x) if dtype == "bfloat16" else x.astype(_cupy.require_cupy().float32)


def flash_forward(q, k, v, scale: float, causal: bool, dtype: str = "float16", n_splits: int | None = None):
    """FlashAttention-2 on the tensor cores (``_flash_forward``), a non-finite v kept to the rows that see it
    (``_with_nonfinite_v``)."""
    return _with_nonfinite_v(_flash_forward, q, k, v, scale, causal, dtype, n_splits=n_splits)


def _flash_forward(q, k, v, scale: float, causal: bool, dtype: str = "float16", n_splits: int | None = None):
    """FlashAttention-2 on CuPy arrays q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d), C-contiguous, float16 (or uint16
    bfloat16 bits with ``dtype="bfloat16"``); returns (o like q, lse float32 (B, Hq, Nq)). ``n_splits`` forces
    the number of key splits (1: no split); by default ``split_count`` picks it."""
    cupy = _cupy.require_cupy()
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not supported(dtype, d):
        raise ValueError(f"the tensor-core kernel takes float16/bfloat16 and head dims {HEAD_DIMS}; got {dtype}, "
                         f"d={d} (use backend='numba-cuda')")
    element = cupy.uint16 if dtype == "bfloat16" else cupy.float16
    for name, x, shape in (("q", q, (B, Hq, Nq, d)), ("k", k, (B, Hkv, Nk, d)), ("v", v, (B, Hkv, Nk, d))):
        _cupy.check_launch_array(name, x, element, shape)
    o = cupy.empty_like(q)
    lse = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    if B * Hq * Nq == 0:
        return o, lse
    kernel, shared_bytes = _flash_kernel(dtype, d, cupy.cuda.Device().id)
    Tr = math.ceil(Nq / BR)
    if n_splits is None:
        n_splits = split_count(B * Hq * Tr, math.ceil(Nk / BC), _cupy.multiprocessor_count())
    # the query tile fastest, as flash-attn (the kernel's header): the blocks in flight share their heads' K and V.
    # x holds up to 2^31 − 1 blocks (CUDA C++ Programming Guide, "Technical Specifications per Compute
    # Capability"), more than fit in memory (each tile has a row of q at least: 2^31 rows of d >= 64 float16 values
    # are 256 GiB); y, the splits, 65535 (split_count gives at most MAX_SPLITS)
    blockspergrid = (B * Hq * Tr, n_splits)
    threadsperblock = (BR // 16 * 32,)
    log2e = 1.4426950408889634  # softmax in base 2: e^x = 2^(x · log2 e)
    null = np.uint64(0)
    o_part = lse_part = None
    if n_splits > 1:
        o_part = cupy.empty((n_splits, B * Hq, Nq, d), dtype=cupy.float32)
        lse_part = cupy.empty((n_splits, B * Hq, Nq), dtype=cupy.float32)
    kernel(blockspergrid, threadsperblock,
           (q, k, v, o, lse, null if o_part is None else o_part, null if lse_part is None else lse_part,
            np.int32(Hq), np.int32(Hkv), np.int32(Nq), np.int32(Nk), np.float32(scale * log2e),
            np.int32(bool(causal))), shared_mem=shared_bytes)
    if n_splits > 1:
        combine = _cupy.kernel(SOURCE, f"ioaware::flash_combine<{CTYPES[dtype]}, {d}>", NAMES)
        rows = B * Hq * Nq
        combine((_gpu.blocks(rows * d, COMBINE_THREADS),), (COMBINE_THREADS,),
                (o_part, lse_part, o, lse, np.int32(rows), np.int32(n_splits)))
    return o, lse


def standard_forward(q, k, v, scale: float, causal: bool, dtype: str = "float16"):
    """The standard algorithm on CuPy (``_standard_forward``), a non-finite v kept to the rows that see it
    (``_with_nonfinite_v``)."""
    return _with_nonfinite_v(_standard_forward, q, k, v, scale, causal, dtype)


def _standard_forward(q, k, v, scale: float, causal: bool, dtype: str = "float16"):
    """S = Q Kᵀ (cuBLAS), P = softmax(S) in place (the CUDA C kernel), O = P V (cuBLAS), on float16 CuPy arrays;
    S is B·Hq·Nq·Nk elements of device memory, refused before allocation when the device has less free."""
    cupy = _cupy.require_cupy()
    if dtype != "float16":
        raise ValueError("the standard baseline runs in float16 (CuPy's matmul has no bfloat16)")
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    _gpu.ensure_device_fits(B * Hq * Nq * Nk * 2, f"attention(algorithm='standard') for S of shape "
                                                  f"({B}, {Hq}, {Nq}, {Nk}) in float16", tier="cupy")
    q_g = q.reshape(B, Hkv, group * Nq, d)  # the query heads of one group stacked against their kv head
    s = cupy.matmul(q_g, k.transpose(0, 1, 3, 2)).reshape(B, Hq, Nq, Nk)  # S = Q Kᵀ, (B, Hq, Nq, Nk)
    lse = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    kernel = _cupy.kernel(SOURCE, f"ioaware::softmax_rows<__half, {SOFTMAX_THREADS}>", NAMES)  # grid.x: B·Hq·Nq rows
    kernel((B * Hq * Nq,), (SOFTMAX_THREADS,),
           (s, lse, np.int32(Nq), np.int32(Nk), np.float32(scale), np.int32(bool(causal))))
    o = cupy.matmul(s.reshape(B, Hkv, group * Nq, Nk), v).reshape(B, Hq, Nq, d)  # O = P V, (B, Hq, Nq, d)
    return o, lse


def to_bfloat16_bits(x):
    """float32/float16 CuPy array -> uint16 bit patterns of bfloat16 (round to nearest even)."""
    cupy = _cupy.require_cupy()
    u = cupy.asarray(x, dtype=cupy.float32).view(cupy.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF  # round half to even on the 16 bits dropped (IEEE 754)
    return ((u + rounding) >> 16).astype(cupy.uint16)


def from_bfloat16_bits(bits):
    """uint16 bfloat16 bit patterns -> float32 CuPy array."""
    cupy = _cupy.require_cupy()
    return (bits.astype(cupy.uint32) << 16).view(cupy.float32)
