"""SnapKV on the GPU, the CUDA C tier (``snapkv.cu``, loaded with CuPy's RawModule): window votes (one fused
kernel, or S = Q_w Kᵀ by cuBLAS then row statistics and column sums), pooling, the GQA mean, a radix-select top-k
per head (O(N), exact with the CPU tier's tie rule), and the gather."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .._common import cuda_c as _cupy, gpu as _gpu

SOURCE = Path(__file__).with_name("snapkv.cu")
THREADS = 256  # threads per block of the window votes and the top-k (powers of two: tree reductions and scans)
FLAT_THREADS = 256
NAMES = (f"ioaware::window_votes<{THREADS}>", f"ioaware::window_row_stats<{THREADS}>", "ioaware::window_column_votes",
         f"ioaware::topk_radix<{THREADS}>", "ioaware::pool_rows", "ioaware::group_mean",
         "ioaware::gather_rows<unsigned short>", "ioaware::gather_rows<float>")
VOTES = ("auto", "kernel", "gemm")  # how the window votes are computed: one fused kernel, or S = Q_w Kᵀ by cuBLAS first


def _kernel(name):
    return _cupy.kernel(SOURCE, name, NAMES)


def _votes_gemm(qw, k, scale):
    """Window votes (B, Hq, N − w) from S = Q_w Kᵀ (B, Hq, w, N), one cuBLAS product per kv head with its group's
    window queries stacked, then the row statistics and the column sums."""
    cupy = _cupy.require_cupy()
    B, Hq, w, d = qw.shape
    Hkv, N = k.shape[1], k.shape[2]
    _gpu.ensure_device_fits(B * Hq * w * N * 4, f"SnapKV's window scores S of shape ({B}, {Hq}, {w}, {N})",
                            tier="cupy")
    s = cupy.matmul(qw.reshape(B, Hkv, (Hq // Hkv) * w, d), k.transpose(0, 1, 3, 2))  # (B, Hkv, group·w, N)
    s = cupy.ascontiguousarray(s.reshape(B * Hq * w, N))  # (B·Hq·w, N), row (b·Hq + h)·w + i
    row_max = cupy.empty(B * Hq * w, dtype=cupy.float32)
    row_sum = cupy.empty_like(row_max)
    _kernel(f"ioaware::window_row_stats<{THREADS}>")((B * Hq * w,), (THREADS,),
                                                     (s, np.int32(w), np.int32(N), np.float32(scale), row_max,
                                                      row_sum))
    votes = cupy.empty((B, Hq, N - w), dtype=cupy.float32)
    if votes.size:
        _kernel("ioaware::window_column_votes")((_gpu.blocks(votes.size, FLAT_THREADS),), (FLAT_THREADS,),
                                                (s, row_max, row_sum, np.int32(B * Hq), np.int32(w), np.int32(N),
                                                 np.float32(scale), votes))
    return votes


def snapkv_scores(qw, k, kernel_size: int, pooling: str, gqa: str, votes_by: str = "auto"):
    """Pooled window votes, float32 (B, Hkv or Hq, N − w), from CuPy arrays qw (B, Hq, w, d), k (B, Hkv, N, d).
    ``votes_by="gemm"`` computes S = Q_w Kᵀ once with cuBLAS, ``"kernel"`` recomputes each score in one fused kernel
    (one block per query head) and stores no S; both are checked against the oracle by the GPU check and
    tests/kernels/test_cupy.py. ``"auto"`` takes the GEMM where S fits in half the free device memory: on the H200
    (reports/gpu/2026-12-04T1110-h200, Hq = 32, Hkv = 8, N = 32768, d = 128, w = 32) it took 0.60 ms against the
    fused kernel's 207 ms, whose 32 blocks leave most of the 132 SMs idle."""
    cupy = _cupy.require_cupy()
    if votes_by not in VOTES:
        raise ValueError(f"unknown votes_by {votes_by!r}; known: {', '.join(map(repr, VOTES))}")
    qw, k = _cupy.as_cupy(qw, np.float32), _cupy.as_cupy(k, np.float32)
    B, Hq, w, d = qw.shape
    Hkv, N = k.shape[1], k.shape[2]
    P = N - w
    if votes_by == "auto":
        votes_by = "gemm" if 2 * B * Hq * w * N * 4 <= _gpu.free_device_bytes("cupy") else "kernel"
    if votes_by == "gemm":
        votes = _votes_gemm(qw, k, 1.0 / math.sqrt(d))
    else:
        votes = cupy.empty((B, Hq, P), dtype=cupy.float32)
        shared_bytes = d * 4  # the current window query
        _kernel(f"ioaware::window_votes<{THREADS}>")((B * Hq,), (THREADS,),
                                                     (qw, k, np.int32(Hq), np.int32(Hkv), np.int32(w), np.int32(N),
                                                      np.int32(d), np.float32(1.0 / math.sqrt(d)), votes),
                                                     shared_mem=shared_bytes)
    pooled = cupy.empty_like(votes)
    _kernel("ioaware::pool_rows")((_gpu.blocks(votes.size, FLAT_THREADS),), (FLAT_THREADS,),
                                  (votes, np.int32(B * Hq), np.int32(P), np.int32(kernel_size),
                                   np.int32(pooling == "max"), pooled))
    if gqa == "per-query-head":
        return pooled
    mean = cupy.empty((B, Hkv, P), dtype=cupy.float32)
    _kernel("ioaware::group_mean")((_gpu.blocks(mean.size, FLAT_THREADS),), (FLAT_THREADS,),
                                   (pooled, np.int32(B), np.int32(Hkv), np.int32(Hq // Hkv), np.int32(P), mean))
    return mean


def select_and_gather(scores, k, v, n_keep: int, window: int):
    """Top ``n_keep`` prefix positions per head (ties to the lower position; all of them when ``n_keep`` exceeds
    the N − w there are) and the window, and their K and V rows; scores (B, H, N − w) float32, k and v
    (B, Hkv, N, d) of a 2- or 4-byte dtype, C-contiguous. Returns (k_c, v_c, kept)."""
    cupy = _cupy.require_cupy()
    B, H, P = scores.shape
    Hkv, N, d = k.shape[1], k.shape[2], k.shape[3]
    if k.dtype.itemsize not in (2, 4):
        raise TypeError(f"the gather copies 2- or 4-byte elements; k and v are {k.dtype}")
    _cupy.check_launch_array("scores", scores, np.float32, (B, H, P), align=4)
    _cupy.check_launch_array("k", k, k.dtype, (B, Hkv, N, d), align=k.dtype.itemsize)
    _cupy.check_launch_array("v", v, k.dtype, (B, Hkv, N, d), align=k.dtype.itemsize)
    n_keep = min(n_keep, P)  # no more prefix positions than there are: every row of `kept` is written
    C = n_keep + window
    kept = cupy.empty((B, H, C), dtype=cupy.int64)
    _kernel(f"ioaware::topk_radix<{THREADS}>")((B * H,), (THREADS,),
                                               (scores, np.int32(P), np.int32(n_keep), np.int32(window),
                                                np.int32(N), kept))
    k_c = cupy.empty((B, H, C, d), dtype=k.dtype)
    v_c = cupy.empty_like(k_c)
    element = {2: "unsigned short", 4: "float"}[k.dtype.itemsize]
    view = {2: cupy.uint16, 4: cupy.float32}[k.dtype.itemsize]
    if k_c.size:
        _kernel(f"ioaware::gather_rows<{element}>")(
            (_gpu.blocks(k_c.size, FLAT_THREADS),), (FLAT_THREADS,),
            (k.view(view), v.view(view), kept, np.int32(B), np.int32(H), np.int32(Hkv), np.int32(N), np.int32(C),
             np.int32(d), k_c.view(view), v_c.view(view)))
    return k_c, v_c, kept
