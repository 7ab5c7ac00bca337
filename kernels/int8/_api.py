"""LLM.int8()'s public functions: vector-wise quantization, the split matmul on every tier, a naive baseline, and
``Int8Linear``."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numba
import numpy as np

from .._common import gpu as _gpu
from .._common.dispatch import choose_backend
from .._common.dtypes import check_finite, check_float_dtype
from .._common.memory import copy_bytes, ensure_fits
from .._common.threads import serial_if_small
from . import _avx2, _numba_cpu, _vnni, rows
from ._numba_cpu import MAX_EXACT_K, QMAX, SMALL_M

GEMM_TASK = (32, 128)  # BM rows of X by BN rows of W per CPU task (measured: 32x128, 64x64, 128x32 within 5%)
# The integer dot-product path (_vnni: vpdpbusd) where the CPU Numba compiles for has it, else the portable loop
# (_numba_cpu). Tests set it to force either path; it must stay False where _vnni.AVAILABLE is False.
USE_VNNI = _vnni.AVAILABLE


FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4e38 (IEEE 754 binary32)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 1.18e-38, the smallest normal binary32


def _check_float(name, x, ndim=None, *, axis=-1, float16_from=None):
    """Type, dtype and shape, then, in one pass over the absmax of every vector along ``axis``, the values the int8
    path can represent (``_check_absmax``)."""
    _check_float_type(name, x, ndim)
    if x.size:
        _check_absmax(name, np.abs(x).max(axis=axis), float16_from)  # NaN where a vector holds a NaN


def _outliers_from(threshold):
    """``float16_from`` of an input x at ``threshold``: the threshold where it is a number > 0 (x's values from it
    on are outliers, which go through float16), else None."""
    return float(threshold) if isinstance(threshold, numbers.Real) and not isinstance(threshold, bool) \
        and threshold > 0 else None


def _check_float_type(name, x, ndim=None):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray; got {type(x).__name__}")
    check_float_dtype(name, x)
    _check_ndim(name, x, ndim)


def _check_absmax(name, amax, float16_from=None):
    """The values the int8 path can represent, from the absmax of every vector of ``name`` (``amax``, non-empty;
    NaN or inf where the vector holds a NaN or ±inf): finite, within float32 (it computes in float32), no vector
    whose largest magnitude is below float32's normal range (127 / absmax would overflow: all-zero codes), and where
    values from ``float16_from`` on go through float16 (None: none do), none from max(``float16_from``, 65520) on,
    where float16 rounds to inf: 0 for a kept float16 weight, every value of which does; a call's threshold > 0 for
    its input, whose outliers do (a value of 70000 below a threshold of 1e5 is quantized to int8 like any other)."""
    if not np.isfinite(amax).all():
        raise ValueError(f"{name} contains NaN or ±inf, which int8 cannot represent")
    top = float(amax.max())
    if top > FLOAT32_MAX:
        raise ValueError(f"{name} has values up to {top:.3g}, beyond float32's range ({FLOAT32_MAX:.3g}), which the "
                         f"int8 kernels compute in")
    if float16_from is not None and top >= max(_numba_cpu.FLOAT16_MAX_ROUNDABLE, float16_from):
        raise ValueError(f"{name} has values up to {top:.6g}; the outlier dimensions go through float16, which "
                         f"rounds them to inf from {_numba_cpu.FLOAT16_MAX_ROUNDABLE:g} on: scale {name} down, or "
                         f"pass threshold=0 (int8 only)")
    tiny = amax[(amax > 0) & (amax < FLOAT32_TINY)]
    if tiny.size:
        raise ValueError(f"{name} has a vector whose largest magnitude, {float(tiny.min()):.3g}, is below float32's "
                         f"normal range ({FLOAT32_TINY:.3g}): its int8 scale 127 / absmax would overflow")


def _check_ndim(name, x, ndim):
    if ndim == "matrix" and x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N, K) = (out_features, in_features), as torch.nn.Linear.weight; "
                         f"got shape {tuple(x.shape)}")
    if ndim == "vectors" and x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (..., K); got a scalar")


def _check_k(x_shape, w_shape):
    """x (..., K) against a weight (N, K): the same K, and few enough products for an exact int32 sum."""
    K = w_shape[1]
    if x_shape[-1] != K:
        raise ValueError(f"x has K = {x_shape[-1]} (last axis) but w has K = {K} (last axis: w is (N, K) = "
                         f"(out_features, in_features))")
    if K > MAX_EXACT_K:
        raise ValueError(f"K = {K} int8 products can overflow an int32 sum; at most {MAX_EXACT_K} are exact")


def _check_threshold(threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"threshold must be a real number; got {type(threshold).__name__}")
    if math.isnan(threshold) or threshold < 0:
        raise ValueError(f"threshold must be >= 0 (0 turns the outlier decomposition off); got {threshold}")
    return float(threshold)


def quantize_vectorwise(x, axis=-1):
    """Absmax int8 quantization with one scale per vector along ``axis``.

    Parameters
    ----------
    x : ndarray, float16/32/64
    axis : int
        The axis the absmax is taken over: ``-1`` gives one scale per row of a matrix, ``0`` one per column.

    Returns
    -------
    x_i8 : ndarray, int8, the shape of ``x``
        round-half-even(x · 127 / absmax), in [-127, 127]; zeros where the vector is all zero.
    absmax : ndarray, float32, ``x.shape`` without ``axis``

    Raises
    ------
    TypeError, ValueError
        Non-float input, NaN or ±inf, an axis out of range.

    Notes
    -----
    LLM.int8() (Dettmers et al. 2022), §3.1 (absmax quantization) and §3.2 (vector-wise). Computed in float32;
    a row-wise pass reads each row once from memory (absmax and rounding while it is in cache).
    """
    valid_axis = (isinstance(axis, numbers.Integral) and not isinstance(axis, bool)
                  and -np.ndim(x) <= axis < np.ndim(x))
    _check_float_type("x", x, "vectors")
    # float16 and float32 values are float32 values: the kernel's absmax, NaN or inf where a vector holds one, is
    # checked after it, one pass over x instead of two (the check's own pass took 44-62 us of a ~180 us call at
    # 128 x 1024 float32, 2-vCPU AMD EPYC, Zen 3); float64 may leave float32's range in the conversion: checked first
    check_after = valid_axis and x.dtype != np.float64
    if not check_after and x.size:  # x first, then the axis
        _check_absmax("x", np.abs(x).max(axis=axis if valid_axis else None))
    if not valid_axis:
        raise ValueError(f"axis must be an int in [{-x.ndim}, {x.ndim - 1}]; got {axis!r}")
    last = axis % x.ndim == x.ndim - 1  # vectors along the last axis: no axis moved (np.moveaxis takes ~4 us)
    moved = x.astype(np.float32, copy=False) if last else np.moveaxis(x.astype(np.float32, copy=False), axis, -1)
    rows = np.ascontiguousarray(moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]))  # (vectors, length)
    x_i8 = np.empty(rows.shape, dtype=np.int8)
    absmax = np.empty(rows.shape[0], dtype=np.float32)
    with serial_if_small(elements=rows.size):  # an element pass: small inputs on the calling thread (_common.threads)
        _numba_cpu.quantize_rows(rows, np.zeros(rows.shape[1], dtype=np.bool_), x_i8, absmax)
    if check_after and x.size:
        _check_absmax("x", absmax)
    x_i8 = x_i8.reshape(moved.shape) if last else np.moveaxis(x_i8.reshape(moved.shape), -1, axis)
    return x_i8, absmax.reshape(moved.shape[:-1])


@dataclass(frozen=True)
class Int8Weight:
    """A weight W (N, K) = (out_features, in_features), as ``torch.nn.Linear.weight`` stores it, quantized
    row-wise: one absmax per output feature (LLM.int8() §3.2, vector-wise), so each output is a dot product of two
    contiguous int8 rows; optionally a float16 copy for the outlier input features; and the row sums
    Σ_k w_i8[n, k] that the dot-product path subtracts its activation offset with (computed here once when not
    given).

    The arrays are checked when it is made (dtype, shape; absmax finite and >= 0) and kept C-contiguous (a copy
    where they are not): the kernels read them as raw rows. Given row sums are taken as they are (checking them is
    a pass over the weight, which is what computing them costs); measurements that do not need correct outputs
    pass zeros."""

    w_i8: np.ndarray  # (N, K) int8
    absmax: np.ndarray  # (N,) float32
    w_fp16: np.ndarray | None = None  # (N, K) float16, only with keep_fp16_weights
    w_row_sums: np.ndarray | None = field(default=None, repr=False)  # (N,) int32

    def __post_init__(self):
        for name, dtype, optional in (("w_i8", np.int8, False), ("absmax", np.float32, False),
                                      ("w_fp16", np.float16, True), ("w_row_sums", np.int32, True)):
            a = getattr(self, name)
            if a is None and optional:
                continue
            if not isinstance(a, np.ndarray) or a.dtype != dtype:
                raise TypeError(f"Int8Weight's {name} must be a numpy.ndarray of {np.dtype(dtype).name}; got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")
            object.__setattr__(self, name, np.ascontiguousarray(a))
        if self.w_i8.ndim != 2 or 0 in self.w_i8.shape:
            raise ValueError(f"Int8Weight's w_i8 must be (N, K) with N, K >= 1; got shape {self.w_i8.shape}")
        N, K = self.w_i8.shape
        for name, shape in (("absmax", (N,)), ("w_fp16", (N, K)), ("w_row_sums", (N,))):
            a = getattr(self, name)
            if a is not None and a.shape != shape:
                raise ValueError(f"Int8Weight's {name} must have shape {shape} for w_i8 {self.w_i8.shape}; got "
                                 f"{a.shape}")
        if not (np.isfinite(self.absmax).all() and (self.absmax >= 0).all()):
            raise ValueError("Int8Weight's absmax must be finite and >= 0 (each row's largest magnitude)")
        object.__setattr__(self, "_top", float(self.absmax.max()))  # the weight's largest magnitude, for
        # ``_check_outlier_weights`` at every call
        if self.w_row_sums is None:
            sums = np.empty(self.w_i8.shape[0], dtype=np.int32)  # (N,)
            with serial_if_small(multiply_adds=self.w_i8.size):  # a pass over the int8 weight, as a GEMV's
                _vnni.row_sums(self.w_i8, sums)
            object.__setattr__(self, "w_row_sums", sums)

    @property
    def shape(self):
        """(N, K) = (out_features, in_features)."""
        return tuple(self.w_i8.shape)

    @property
    def nbytes(self) -> int:
        extra = self.w_fp16.nbytes if self.w_fp16 is not None else 0
        return self.w_i8.nbytes + self.absmax.nbytes + self.w_row_sums.nbytes + extra

    @classmethod
    def from_float(cls, w, keep_fp16_weights=False):
        """Quantize a float weight w (N, K) = (out_features, in_features)."""
        _check_float("w", w, "matrix", float16_from=0.0 if keep_fp16_weights else None)
        if 0 in w.shape:
            raise ValueError(f"w must have out_features and in_features >= 1; got shape {w.shape}")
        w32 = np.ascontiguousarray(w, dtype=np.float32)
        N, K = w32.shape
        w_i8 = np.empty((N, K), dtype=np.int8)
        absmax = np.empty(N, dtype=np.float32)
        with serial_if_small(elements=w32.size):  # an element pass: small weights on the calling thread
            _numba_cpu.quantize_rows(w32, np.zeros(K, dtype=np.bool_), w_i8, absmax)
        return cls(w_i8, absmax, w32.astype(np.float16) if keep_fp16_weights else None)

    def outlier_weights_fp16(self, dims):
        """The weights of the input features ``dims`` in float16, (J, N): the kept copy, or dequantized from int8
        (int8 · absmax / 127)."""
        if self.w_fp16 is not None:
            return np.ascontiguousarray(self.w_fp16[:, dims].T)
        return (self.w_i8[:, dims].T.astype(np.float32) * (self.absmax / np.float32(QMAX))).astype(np.float16)


def int8_gemm(x_i8, w_i8):
    """Exact int32 product x_i8 · w_i8ᵀ of int8 x (M, K) and an int8 weight (N, K): (M, N) int32."""
    for name, a in (("x_i8", x_i8), ("w_i8", w_i8)):
        if not isinstance(a, np.ndarray) or a.dtype != np.int8:
            raise TypeError(f"{name} must be an int8 numpy.ndarray; got {getattr(a, 'dtype', type(a).__name__)}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D; got shape {a.shape}")
    if x_i8.shape[1] != w_i8.shape[1]:
        raise ValueError(f"x_i8 (M, K) and w_i8 (N, K) must share K; got x_i8 {x_i8.shape}, w_i8 {w_i8.shape}")
    M, K = x_i8.shape
    if K > MAX_EXACT_K:
        raise ValueError(f"K = {K} int8 products can overflow an int32 sum; at most {MAX_EXACT_K} are exact")
    N = w_i8.shape[0]
    copies = copy_bytes((x_i8, w_i8), np.int8)
    ensure_fits(4 * M * N + copies + M * K + 4 * N, f"int8_gemm's ({M}, {N}) int32 result (with its operands' "
                f"offset or contiguous copies and row sums)")
    w_i8 = np.ascontiguousarray(w_i8)
    w_row_sums = None
    with serial_if_small(multiply_adds=M * K * w_i8.shape[0]):  # a small product on the calling thread, its
        # weights' row sums (N·K adds) with it
        if USE_VNNI:
            w_row_sums = np.empty(w_i8.shape[0], dtype=np.int32)  # (N,)
            _vnni.row_sums(w_i8, w_row_sums)
        return _int32_product(np.ascontiguousarray(x_i8), w_i8, w_row_sums)


def product_path() -> str:
    """The instructions the CPU's int8 products take now: "vpdpbusd" (AVX512-VNNI, ``_vnni``), "vpmaddubsw" (AVX2,
    ``_avx2``; a GEMM whose activations hold −128 takes the loop) or "loop" (LLVM's vectorization of the plain
    loop); for benchmark and report rows."""
    if USE_VNNI:
        return "vpdpbusd"
    return "vpmaddubsw" if _avx2.AVAILABLE else "loop"


def _int32_product(x_i8, w_i8, w_row_sums, quantized=False):
    """(M, N) int32 = x_i8 (M, K) · w_i8ᵀ, on vpdpbusd (with the weights' row sums), vpmaddubsw or the portable
    loop. ``quantized``: x_i8 comes from the quantizer, so no value is −128 and the check for one is skipped."""
    out = np.empty((x_i8.shape[0], w_i8.shape[0]), dtype=np.int32)  # (M, N)
    if USE_VNNI:
        _vnni.gemm_i8(_vnni.offset_activations(x_i8), w_i8, w_row_sums, out)
    elif _avx2.AVAILABLE and (quantized or x_i8.size == 0 or x_i8.min() > -128):  # vpmaddubsw's sign trick needs
        # x >= −127 (figures in _avx2, v2)
        _avx2.gemm_i8(x_i8, w_i8, out, *GEMM_TASK)
    else:
        _numba_cpu.gemm_i8(x_i8, w_i8, out, *GEMM_TASK)
    return out


def _split_matmul(x, weight: Int8Weight, threshold):
    """The decomposition itself; returns (y float32 (M, N), outlier column indices)."""
    M, K = x.shape
    if K > MAX_EXACT_K:
        raise ValueError(f"K = {K} int8 products can overflow an int32 sum; at most {MAX_EXACT_K} are exact")
    if M <= SMALL_M:
        return _split_gemv(x, weight, threshold)
    return _split_matmul_kernels(x, weight, threshold)


def _split_matmul_kernels(x, weight: Int8Weight, threshold):
    """Detection, quantization, int8 GEMM, dequantization and the outlier product as five Numba kernels."""
    M, K = x.shape
    N = weight.w_i8.shape[0]
    flags = np.zeros(K, dtype=np.bool_)
    # the passes over x and the small products run on the calling thread when small (``_common.threads``): each
    # region a call launches can meet another pool's spinning thread
    with serial_if_small(elements=x.size):
        if threshold > 0:
            _numba_cpu.outlier_flags(x, np.float32(threshold), flags)
    outliers = np.flatnonzero(flags)
    # int8 part: row-wise absmax of x over the regular columns (outlier columns quantize to 0), column-wise
    # absmax of w, exact int32 product, dequantize
    absmax_x = np.empty(M, dtype=np.float32)
    y = np.empty((M, N), dtype=np.float32)  # (M, N)
    if USE_VNNI:  # quantized straight into the offset operand; dequantized in the GEMM's epilogue
        x_u8 = np.empty((M, (K + 3) // 4 * 4), dtype=np.uint8)  # (M, K rounded up to 4)
        with serial_if_small(elements=x.size):
            _vnni.quantize_rows(x, flags, x_u8, absmax_x)
        with serial_if_small(multiply_adds=M * K * N):
            _vnni.gemm_i8(x_u8, weight.w_i8, weight.w_row_sums, y, absmax_x, weight.absmax)
    else:
        x_i8 = np.empty((M, K), dtype=np.int8)
        with serial_if_small(elements=x.size):
            _numba_cpu.quantize_rows(x, flags, x_i8, absmax_x)
        with serial_if_small(multiply_adds=M * K * N):
            c = _int32_product(x_i8, weight.w_i8, weight.w_row_sums, quantized=True)  # (M, N) int32, exact
        with serial_if_small(elements=c.size):
            _numba_cpu.dequantize(c, absmax_x, weight.absmax, y)
    # float16 part: the outlier columns of x against the matching rows of w, accumulated in float32
    if outliers.size:
        x_out = x[:, outliers].astype(np.float16).astype(np.float32)  # (M, J)
        w_out = weight.outlier_weights_fp16(outliers).astype(np.float32)  # (J, N)
        with serial_if_small(multiply_adds=M * outliers.size * N):
            _numba_cpu.add_outlier_product(x_out, w_out, y)
    return y, outliers


def _split_gemv(x, weight: Int8Weight, threshold):
    """The decomposition for a few rows in one Numba launch (weights kept as int8 only), or, with a kept float16
    copy, the five-kernel path (Numba has no float16 arrays on the CPU)."""
    if weight.w_fp16 is not None:
        return _split_matmul_kernels(x, weight, threshold)
    flags = np.empty(x.shape[1], dtype=np.bool_)
    y = np.empty((x.shape[0], weight.w_i8.shape[0]), dtype=np.float32)
    with serial_if_small(multiply_adds=x.size * y.shape[1]):  # M·K·N: a small product on the calling thread
        if x.shape[0] == 1 and numba.get_num_threads() == 1 and rows.ROW_PREFETCH:
            # one vector on one thread, where the rows' prefetch is on (``rows.ROW_PREFETCH``: not on AMD): the
            # row kernel (the fused decode step's before its panels), whose four streams and prefetch keep one core's
            # reads in flight
            # (``rows.gemv``: K = N = 2048 streamed from DRAM, against ``_vnni.split_gemv`` when it read four
            # adjacent rows at once, 0.52 -> 0.39 ms on a 2-vCPU AMD EPYC). Without the prefetch, one row at a time
            # is faster on one thread: ``_vnni.split_gemv`` now, against ``rows.gemv`` without prefetch on the same
            # AMD EPYC (Zen 4), weights from DRAM, four outlier features, alternating call by call: 2048² 0.111-0.155
            # against 0.218-0.257 ms, 1024² 0.031 against 0.061 ms (two runs each); after a 64 MiB read between
            # calls 0.269 against 0.338 ms and 0.130 against 0.128; only with the weight kept in the cache (the same
            # one called again and again) it is slower, 0.123 against 0.112 ms and 0.045 against 0.036
            rows.gemv(rows.path_marker(USE_VNNI), x, np.float32(threshold), weight.w_i8, weight.absmax,
                      weight.w_row_sums, y[0], flags, rows.ROW_PREFETCH)
        elif USE_VNNI:  # the dot-product path where the CPU has it, else the portable loop
            _vnni.split_gemv(x, np.float32(threshold), weight.w_i8, weight.absmax, weight.w_row_sums, y, flags)
        else:
            _numba_cpu.split_gemv(x, np.float32(threshold), weight.w_i8, weight.absmax, y, flags)
    return y, np.flatnonzero(flags)


def _as_weight(w, keep_fp16_weights=False):
    if isinstance(w, Int8Weight):
        return w
    if isinstance(w, Int8Linear):
        return w.weight
    return Int8Weight.from_float(w, keep_fp16_weights)


def _check_gpu_call(x, w, threshold):
    """The checks both GPU tiers make: (weight or None, K, N, x's shape, threshold). ``weight`` is the
    ``Int8Weight`` when w is pre-quantized, None when w is a float matrix to quantize on the device."""
    outliers_from = _outliers_from(threshold)
    _check_any_float("x", x, "vectors", float16_from=outliers_from)
    weight = None
    if isinstance(w, (Int8Weight, Int8Linear)):
        weight = _as_weight(w)
        _check_outlier_weights(weight, outliers_from or 0)
        N, K = weight.shape
    else:
        _check_any_float("w", w, "matrix", float16_from=None if outliers_from is None else 0.0)
        N, K = tuple(w.shape)
    x_shape = tuple(x.shape)  # (a simulator array's shape is no tuple)
    _check_k(x_shape, (N, K))
    return weight, K, N, x_shape, _check_threshold(threshold)


def _int8_matmul_numba_cuda(x, w, threshold):
    """``int8_matmul`` on the Numba-CUDA tier: NumPy in, NumPy out; device arrays in, device arrays out."""
    from . import _numba_cuda

    on_host = isinstance(x, np.ndarray)
    weight, K, N, x_shape, threshold = _check_gpu_call(x, w, threshold)
    if weight is not None:
        if weight.w_fp16 is not None:
            raise ValueError("backend='numba-cuda' dequantizes the outlier rows from int8; an Int8Weight with "
                             "keep_fp16_weights is CPU-only")
        w_i8, absmax_w = _gpu.to_numba(weight.w_i8), _gpu.to_numba(weight.absmax)
    else:
        w_dev = _numba_cuda.cast_f32(_gpu.to_numba(np.ascontiguousarray(w, dtype=np.float32) if on_host
                                                    else _gpu.contiguous(w)))
        w_i8, absmax_w = _numba_cuda.quantize_weight(w_dev)
    x_dev = _gpu.to_numba(np.ascontiguousarray(x, dtype=np.float32) if on_host else _gpu.contiguous(x))
    x_dev = _numba_cuda.cast_f32(x_dev).reshape(math.prod(x_shape[:-1]), K)
    y, _ = _numba_cuda.split_matmul(x_dev, w_i8, absmax_w, threshold)
    return _gpu.like_input(y.reshape(x_shape[:-1] + (N,)), on_host)


def _int8_matmul_cupy(x, w, threshold):
    """``int8_matmul`` on the CUDA C tier (tensor cores): NumPy in, NumPy out; device arrays in, CuPy out."""
    from .._common import cuda_c as _cupy
    from . import _cupy as tier2

    cupy = _cupy.require_cupy()
    on_host = isinstance(x, np.ndarray)
    weight, K, N, x_shape, threshold = _check_gpu_call(x, w, threshold)
    w_fp16 = None
    if weight is not None:
        w_i8 = cupy.zeros((N, tier2.padded(K)), dtype=cupy.int8)  # K padded with zeros (16-byte rows)
        w_i8[:, :K] = cupy.asarray(weight.w_i8)
        absmax_w = cupy.asarray(weight.absmax)
        if weight.w_fp16 is not None:
            w_fp16 = cupy.ascontiguousarray(cupy.asarray(weight.w_fp16).T)  # (K, N), as int8_matmul.cu reads it
    else:
        w_i8, absmax_w = tier2.quantize_weight(_cupy.as_cupy(w, np.float32))
    x2d = _cupy.as_cupy(x, np.float32).reshape(math.prod(x_shape[:-1]), K)
    y, _, _ = tier2.split_matmul(x2d, w_i8, absmax_w, threshold, w_fp16)
    y = y.reshape(x_shape[:-1] + (N,))
    return cupy.asnumpy(y) if on_host else y


def _check_any_float(name, x, ndim, float16_from=None):
    """``_check_float`` for NumPy arrays (and anything else), its device twin for device arrays."""
    if _gpu.is_device_array(x):
        _check_device_float(name, x, ndim, float16_from)
    else:
        _check_float(name, x, ndim, float16_from=float16_from)


def _check_device_float(name, x, ndim, float16_from):
    """The checks of ``_check_float`` for a device array: dtype and shape on the host, finiteness on the device,
    and the value ranges on the vectors' absmax, (..., ) copied to the host (one value per vector)."""
    check_float_dtype(name, x)
    _check_ndim(name, x, ndim)
    check_finite(name, x, "which int8 cannot represent")
    if 0 not in tuple(x.shape):
        cupy = _gpu.cupy_module()
        absmax = (cupy.asnumpy(cupy.abs(cupy.asarray(x)).max(axis=-1)) if cupy is not None
                  else np.abs(_gpu.to_host_array(x)).max(axis=-1))  # (vectors,): no CuPy, the array crosses
        _check_absmax(name, absmax, float16_from)


def int8_matmul(x, w, *, threshold=6.0, backend="auto"):
    """LLM.int8() matrix multiplication with mixed-precision decomposition: x · wᵀ, float32 result, with w stored
    (out_features, in_features) as ``torch.nn.functional.linear`` takes it.

    Parameters
    ----------
    x : ndarray, (..., K), float16/32/64
    w : ndarray (N, K) float, or a pre-quantized ``Int8Weight`` / ``Int8Linear``
        N = out_features, K = in_features: the layout of ``torch.nn.Linear.weight``, bitsandbytes and
        ``kernels.dense``.
    threshold : float, >= 0
        Outlier threshold: the hidden dimensions (columns of x) where any |x| >= threshold over all rows of this
        input go through a float16 matmul. ``0`` turns the decomposition off (plain vector-wise int8).

    backend : {"auto", "cpu", "numba-cuda", "cupy"}
        ``"cpu"``: the Numba CPU kernels, for NumPy inputs. ``"numba-cuda"``: the Numba-CUDA kernels
        (``kernels/int8/_numba_cuda.py``); the outlier weights come from their int8 values there (an
        ``Int8Weight`` with a kept float16 copy is refused). ``"cupy"``: the CUDA C kernels on tensor cores
        (``kernels/int8/int8_matmul.cu``). For both GPU backends NumPy inputs are copied to the device and the
        result back. ``"auto"``: device inputs (CuPy, ``__cuda_array_interface__``) on the GPU (tensor cores when
        CuPy is installed), NumPy inputs on the CPU.

    Returns
    -------
    y : ndarray (a device array for device inputs), float32, (..., N)

    Raises
    ------
    TypeError
        Non-array or non-float inputs, a non-numeric threshold, device inputs with ``backend="cpu"``.
    ValueError
        NaN or ±inf in x or w, mismatched K, a negative threshold, K too large for exact int32 sums; with
        threshold > 0, values of w from 65520 on and of x from max(65520, threshold) on (the outlier dimensions go
        through float16).
    kernels.InsufficientMemoryError
        A result and work that would not fit the machine's memory, before anything runs (the CPU tier).

    Notes
    -----
    Dettmers et al. 2022, §3.2 and eq. 7: regular dimensions are quantized row-wise, x per token and w per output
    feature, multiplied in int8 with int32 accumulation and dequantized by absmax_x ⊗ absmax_w / 127²; the
    outlier dimensions use float16 inputs with float32 accumulation.
    """
    on_device = _gpu.is_device_array(x) or _gpu.is_device_array(w)
    if on_device and not (_gpu.is_device_array(x) and (_gpu.is_device_array(w) or isinstance(w, (Int8Weight,
                                                                                                Int8Linear)))):
        raise TypeError("x and w must both be NumPy arrays or both device arrays (w may be an Int8Weight)")
    arrays = {"x": x} if isinstance(w, (Int8Weight, Int8Linear)) else {"x": x, "w": w}
    backend = choose_backend("int8_matmul", backend, arrays)  # every tier takes every float dtype
    if backend == "cupy":
        return _int8_matmul_cupy(x, w, threshold)
    if backend == "numba-cuda":
        return _int8_matmul_numba_cuda(x, w, threshold)
    # x before w, as the GPU tiers check them
    _check_float("x", x, "vectors", float16_from=_outliers_from(threshold))
    y, _ = _int8_matmul_cpu(x, _as_weight(w), _check_threshold(threshold), x_checked=True)
    return y


def _check_outlier_weights(weight: Int8Weight, threshold):
    """With threshold > 0 the weights of the outlier dimensions go through float16 (dequantized from int8, or the
    kept copy): a weight whose values reach 65520 would give inf there, and inf · 0 NaN (``from_float`` refuses
    it only for a kept copy)."""
    if threshold > 0 and weight._top >= _numba_cpu.FLOAT16_MAX_ROUNDABLE:
        _check_absmax("w", np.float32([weight._top]), float16_from=0.0)


def _int8_matmul_cpu(x, weight: Int8Weight, threshold, x_checked=False):
    """The CPU tier on NumPy x (..., K): (y (..., N) float32, the outlier dimensions of this call)."""
    if not x_checked:
        _check_float("x", x, "vectors", float16_from=_outliers_from(threshold))
    _check_outlier_weights(weight, threshold)
    N, K = weight.shape
    _check_k(x.shape, weight.shape)
    M = x.size // K
    # the result and its int32 products, x in float32 and quantized (the outlier dimensions' copies, J·(M + N)
    # values, are known after the outlier scan: a few per thousand features in the paper's models)
    ensure_fits(8 * M * N + 5 * M * K, f"int8_matmul's ({M}, {N}) result and its work")
    x2d = np.ascontiguousarray(x.reshape(-1, K), dtype=np.float32)
    y, outliers = _split_matmul(x2d, weight, threshold)
    return y.reshape(x.shape[:-1] + (N,)), outliers


def naive_absmax_matmul(x, w):
    """x · wᵀ (w (N, K), as ``int8_matmul``) with one absmax scale per tensor for x and for w: the int8 baseline
    that outlier features break."""
    _check_float("x", x, "vectors")
    _check_float("w", w, "matrix")
    _check_k(x.shape, w.shape)
    x_i8, ax = quantize_vectorwise(x.reshape(1, -1), axis=-1)
    w_i8, aw = quantize_vectorwise(w.reshape(1, -1), axis=-1)
    c = int8_gemm(x_i8.reshape(-1, x.shape[-1]), w_i8.reshape(w.shape))
    y = c * np.float32(ax[0] * aw[0] / np.float32(QMAX * QMAX))
    return y.astype(np.float32).reshape(x.shape[:-1] + (w.shape[0],))


class Int8Linear:
    """A linear layer y = x · Wᵀ + bias with LLM.int8() weights, W stored (out_features, in_features) as
    ``torch.nn.Linear`` stores it.

    By default only the int8 weights and their float32 per-output scales are stored (4x fewer bytes than
    float32, as bitsandbytes does at inference); the outlier weights are dequantized from int8 on each call.
    ``keep_fp16_weights=True`` also keeps a float16 copy and uses it for the outliers — the paper's formulation,
    more accurate on the outlier path, at 2 more bytes per weight. A layer holds no per-call state: calls from
    several threads at once are safe.
    """

    def __init__(self, weight: Int8Weight, bias=None, *, threshold=6.0):
        self.weight = weight
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)
        self.threshold = threshold

    @property
    def threshold(self) -> float:
        """The outlier threshold (>= 0; 0 turns the decomposition off), checked whenever it is set."""
        return self._threshold

    @threshold.setter
    def threshold(self, value):
        self._threshold = _check_threshold(value)

    @classmethod
    def from_float(cls, w, bias=None, *, threshold=6.0, keep_fp16_weights=False):
        """Quantize a float weight w (N, K) = (out_features, in_features) (and keep its float32 bias, (N,))."""
        _check_float("w", w, "matrix")
        if bias is not None:
            _check_float("bias", bias)
            if bias.shape != (w.shape[0],):
                raise ValueError(f"bias must have shape ({w.shape[0]},) to match w's N (out_features, first "
                                 f"axis); got {bias.shape}")
        return cls(Int8Weight.from_float(w, keep_fp16_weights), bias, threshold=threshold)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes stored: int8 weights, float32 per-output scales, the float16 copy if kept, and the bias."""
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x, *, return_outliers=False):
        """y = x · Wᵀ + bias for x (..., in_features): float32 (..., out_features); with ``return_outliers``
        also the hidden dimensions this call routed through float16 (int64, ascending)."""
        y, outliers = _int8_matmul_cpu(x, self.weight, self.threshold)
        if self.bias is not None:
            y += self.bias
        return (y, outliers) if return_outliers else y
