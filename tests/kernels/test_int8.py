"""kernels.int8 (LLM.int8()) against its int64/float64 oracles, and its accuracy against float64 matmul."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import kernels
from kernels import int8
from kernels._common.prefetch import PREFETCH_ROWS
from kernels.int8._numba_cpu import _outlier_columns
from kernels.int8 import (Int8Linear, Int8Weight, int8_gemm, int8_matmul, int8_matmul_reference,
                          naive_absmax_matmul, quantize_reference, quantize_vectorwise)
from tests.helpers import BAD_INT8_CALLS, assert_close, planted_int8


@pytest.mark.parametrize("shape, axis", [((1, 1), -1), ((7, 300), -1), ((7, 300), 0), ((5, 3, 33), 1),
                                         ((129,), 0), ((4, 0), -1)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_quantize_vectorwise_equals_the_oracle(rng, shape, axis, dtype):
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    q, absmax = quantize_vectorwise(x, axis=axis)
    q_ref, absmax_ref = quantize_reference(x, axis=axis)
    assert q.dtype == np.int8 and absmax.dtype == np.float32
    assert np.array_equal(q, q_ref) and np.array_equal(absmax, absmax_ref)
    assert q.size == 0 or np.abs(q).max() == 127  # the largest element of a non-zero vector maps to ±127


def test_quantize_rounds_half_to_even_and_keeps_zero_vectors():
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5], [0, 0, 0, 0, 0]], dtype=np.float32)
    q, absmax = quantize_vectorwise(x)
    assert q[0].tolist() == [127, 0, 2, 2, 0] and q[1].tolist() == [0] * 5
    assert absmax.tolist() == [127.0, 0.0]


@pytest.fixture(params=["loop", "vnni"])
def dot_path(request, monkeypatch):
    """Force the int32 products through the portable loop or through vpdpbusd (kernels/int8/_vnni.py)."""
    from kernels.int8 import _api, _vnni

    if request.param == "vnni" and not _vnni.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: only the loop can run here")
    monkeypatch.setattr(_api, "USE_VNNI", request.param == "vnni")
    return request.param


# K not a multiple of 64 (nor of 4), K < 64, N = 1, M = 1, M = 17 (not a multiple of the 6-row micro-tile), N not a
# multiple of the 64-output panel, and more rows than one 96-row task
GEMM_SHAPES = [(1, 1, 1), (1, 8192, 3), (3, 1000, 257), (64, 129, 130), (33, 4096, 1), (17, 63, 65), (17, 64, 64),
               (1, 577, 1), (100, 5, 200), (97, 66, 63), (200, 70, 130)]  # the last: a panel split in uneven runs


@pytest.mark.parametrize("m, k, n", GEMM_SHAPES)
def test_int8_gemm_is_exact(rng, dot_path, m, k, n):
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (n, k), dtype=np.int8)  # (out, in)
    assert np.array_equal(int8_gemm(a, b), a.astype(np.int64) @ b.T.astype(np.int64))


@pytest.mark.parametrize("value_x, value_w", [(-127, -127), (-128, -128), (127, -128), (-128, 127), (127, 127)])
def test_int8_gemm_at_the_extremes_is_exact(dot_path, value_x, value_w):
    # at the largest K int8_gemm takes, every int8 pair: (−128)·(−128) included (with a bound from 127², K = 133144
    # of those wrapped to −2113536000)
    k = int8.MAX_EXACT_K
    assert 128 * 128 * k <= 2**31 - 1 < 128 * 128 * (k + 1)
    a = np.full((1, k), value_x, dtype=np.int8)
    b = np.full((2, k), value_w, dtype=np.int8)
    assert (int8_gemm(a, b) == value_x * value_w * k).all()
    with pytest.raises(ValueError, match="overflow an int32"):
        int8_gemm(np.zeros((1, int8.MAX_EXACT_K + 1), np.int8), np.zeros((1, int8.MAX_EXACT_K + 1), np.int8))


@pytest.mark.parametrize("m", [1, 7, 16, 17, 40])  # the one-launch GEMV (M <= 16) and the GEMM path
@pytest.mark.parametrize("k, n", [(576, 960), (63, 70), (130, 1), (1, 5)])
def test_both_dot_paths_give_identical_results(rng, monkeypatch, m, k, n):
    from kernels.int8 import _api, _vnni

    if not _vnni.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: only the loop can run here")
    x, w, _ = planted_int8(rng, m, k, n, min(3, k))
    layer = Int8Linear.from_float(w)
    monkeypatch.setattr(_api, "USE_VNNI", False)
    loop = layer(x)
    monkeypatch.setattr(_api, "USE_VNNI", True)
    assert np.array_equal(layer(x), loop)  # the int32 sums are exact on both, the float epilogue is shared


def _avx2_or_skip(f16c=False):
    from kernels.int8 import _avx2, _numba_cpu

    if not _avx2.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_avx2.REQUIRED_FEATURES)}: only the loop can run here")
    if f16c and not _numba_cpu.F16C:
        pytest.skip("Numba's target CPU lacks F16C: the rows' AVX2 path (its outlier products round on it) is off")
    return _avx2


@pytest.mark.parametrize("k", [1, 31, 32, 33, 63, 64, 65, 96, 577, 2049])  # tails, one and two chains, K < 32
@pytest.mark.parametrize("offset", [0, 128])  # int8 activations, or the offset bytes of the rows' buffer
@pytest.mark.parametrize("values", ["random", "extremes"])
def test_the_avx2_dot_product_is_exact(rng, k, offset, values):
    from numba import njit

    _avx2 = _avx2_or_skip()
    if values == "random":
        x = rng.integers(-127, 128, 3 * k, dtype=np.int8)  # the quantizer's range: |x| <= 127
        w = rng.integers(-128, 128, 3 * k, dtype=np.int8)
    else:  # every product at ±127·128, the largest |x · w| the sign trick takes
        x = rng.choice(np.array([-127, 127], dtype=np.int8), 3 * k)
        w = rng.choice(np.array([-128, 127], dtype=np.int8), 3 * k)
    stored = (x.view(np.uint8) ^ 0x80) if offset else x  # x + 128, as rows.prepare stores it
    dot = njit(lambda a, a0, b, b0, n, off: _avx2.dot(a, a0, b, b0, n, off))
    # an inner slice at other offsets, so that loads start off a 32-byte boundary
    got = dot(stored, k + 1, w, 2 * k - 1, k, offset)
    assert got == x[k + 1:2 * k + 1].astype(np.int64) @ w[2 * k - 1:3 * k - 1].astype(np.int64)


def test_the_avx2_dot_product_is_exact_at_the_largest_k():
    from numba import njit

    _avx2 = _avx2_or_skip()
    k = int8.MAX_EXACT_K
    x, w = np.full(k, -127, dtype=np.int8), np.full(k, -127, dtype=np.int8)
    dot = njit(lambda a, b, n: _avx2.dot(a, 0, b, 0, n, 0))
    assert dot(x, w, k) == 127 * 127 * k  # 2^31 − 1 − 4071: no lane or sum overflows


def test_the_split_gemvs_row_products_agree(rng):
    from numba import njit

    from kernels.int8 import _numba_cpu

    _avx2_or_skip()
    x = rng.integers(-127, 128, (3, 1000), dtype=np.int8)
    w = rng.integers(-128, 128, (37, 1000), dtype=np.int8)
    oracle = (x.astype(np.int64) @ w.T.astype(np.int64)).tolist()  # (3, 37)
    for product in (_numba_cpu._row_product_loop, _numba_cpu._row_product_avx2):
        pairs = njit(lambda a, b: [[product(a, i, b, j) for j in range(b.shape[0])] for i in range(a.shape[0])])
        assert pairs(x, w) == oracle


# K: under one vector, a tail, whole vectors; N: fewer rows than four quarters, a remainder, several blocks of rows
@pytest.mark.parametrize("k, n", [(20, 3), (33, 7), (576, 130), (1000, 37), (64, 1200)])
@pytest.mark.parametrize("n_outliers", [0, 2])
def test_the_avx2_rows_give_the_loops_outputs_bit_for_bit(rng, k, n, n_outliers):
    from kernels.int8 import rows

    _avx2_or_skip(f16c=True)
    x, w, _ = planted_int8(rng, 1, k, n, n_outliers)
    weight = Int8Weight.from_float(w)
    flags, cols, x_o = np.empty(k, np.bool_), np.empty(k, np.int64), np.empty((1, k), np.float32)
    x_u8, absmax_x = np.empty((1, rows.padded_k(k)), np.uint8), np.empty(1, np.float32)
    J = rows.prepare(x, np.float32(6.0), flags, cols, x_o, x_u8, absmax_x)
    assert J == n_outliers
    for n0, n1 in ((0, n), (1, n - 1), (n // 3, n // 3 + 5)):  # the whole range, and ranges that start inside
        y_loop, y_avx2 = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
        for kernel, y in ((rows._rows_loop, y_loop), (rows._rows_avx2, y_avx2)):
            kernel(x_u8, J, cols, x_o, absmax_x, weight.w_i8, weight.absmax, weight.w_row_sums, y, n0, min(n1, n), 0)
        assert np.array_equal(y_avx2, y_loop, equal_nan=True)  # NaN outside the range on both: nothing else written
        assert not np.isnan(y_loop[n0:min(n1, n)]).any()


@pytest.mark.parametrize("m, k, n", GEMM_SHAPES)
def test_the_avx2_gemm_is_exact(rng, m, k, n):
    from kernels.int8 import _api

    _avx2 = _avx2_or_skip()
    a = rng.integers(-127, 128, (m, k), dtype=np.int8)  # within ±127: the vpmaddubsw product
    b = rng.integers(-128, 128, (n, k), dtype=np.int8)
    out = np.empty((m, n), dtype=np.int32)
    _avx2.gemm_i8(a, b, out, *_api.GEMM_TASK)
    assert np.array_equal(out, a.astype(np.int64) @ b.T.astype(np.int64))


def test_int8_gemm_takes_the_loop_where_an_activation_is_minus_128(rng, monkeypatch):
    from kernels.int8 import _api

    _avx2 = _avx2_or_skip()
    monkeypatch.setattr(_api, "USE_VNNI", False)
    calls = []
    original = _avx2.gemm_i8
    monkeypatch.setattr(_avx2, "gemm_i8", lambda *args: calls.append(1) or original(*args))
    a = rng.integers(-127, 128, (9, 100), dtype=np.int8)
    b = np.full((7, 100), -128, dtype=np.int8)  # where x = −128 too, x · sign(w) wraps: the sign trick fails
    assert np.array_equal(int8_gemm(a, b), a.astype(np.int64) @ b.T.astype(np.int64)) and calls == [1]
    a[4, 17] = -128
    assert np.array_equal(int8_gemm(a, b), a.astype(np.int64) @ b.T.astype(np.int64)) and calls == [1]


def test_the_product_path_names_what_runs(monkeypatch):
    from kernels.int8 import _api, _avx2

    monkeypatch.setattr(_api, "USE_VNNI", True)
    assert int8.product_path() == "vpdpbusd"
    monkeypatch.setattr(_api, "USE_VNNI", False)
    assert int8.product_path() == ("vpmaddubsw" if _avx2.AVAILABLE else "loop")
    monkeypatch.setattr(_avx2, "AVAILABLE", not _avx2.AVAILABLE)
    assert int8.product_path() == ("vpmaddubsw" if _avx2.AVAILABLE else "loop")


def test_the_loop_path_runs_vpmaddubsw_where_the_target_has_avx2(rng):
    from numba import njit

    from kernels.int8 import _numba_cpu, rows

    _avx2_or_skip(f16c=True)
    k, n = 100, 30
    x, w, _ = planted_int8(rng, 1, k, n, 1)
    weight = Int8Weight.from_float(w)
    flags, y = np.empty(k, np.bool_), np.empty(n, np.float32)
    calls = [(_numba_cpu.split_gemv, (x, np.float32(6.0), weight.w_i8, weight.absmax, y[None], flags)),
             (rows.gemv, (rows.path_marker(False), x, np.float32(6.0), weight.w_i8, weight.absmax, weight.w_row_sums,
                          y, flags, 0))]  # the portable path of the rows
    for kernel, args in calls:
        fresh = njit(kernel.py_func)  # compiled here: Numba shows no assembly for cached code
        fresh(*args)
        assert "vpmaddubsw" in fresh.inspect_asm(fresh.signatures[0])


def test_the_dot_product_path_runs_vpdpbusd(rng):
    from numba import njit

    from kernels.int8 import _vnni

    if not _vnni.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: only the loop can run here")
    x, w, _ = planted_int8(rng, 2, 100, 30, 1)
    layer = Int8Linear.from_float(w)
    int8_matmul(x, layer)  # the GEMV
    int8_matmul(np.repeat(x, 20, axis=0), layer)  # the GEMM
    for kernel in (_vnni.split_gemv, _vnni.gemm):
        fresh = njit(parallel=True)(kernel.py_func)  # compiled here: Numba shows no assembly for cached code
        fresh.compile(kernel.signatures[0])
        assert "vpdpbusd" in fresh.inspect_asm(kernel.signatures[0])


@pytest.mark.parametrize("count", [1, 7, 15, 16])
@pytest.mark.parametrize("J", [0, 1, 5])
@pytest.mark.parametrize("where", ["middle", "last rows"])
def test_sixteen_outputs_outlier_products_equal_the_scalar_ones_bit_for_bit(rng, count, J, where):
    from numba import njit

    from kernels.int8 import _vnni
    from kernels.int8._numba_cpu import _plus_outliers

    if not _vnni.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: the vpdpbusd path that uses "
                    "plus_outliers16 does not run here")

    @njit
    def vector(y, n0, count, absmax_w, x_o, cols, J, w):
        _vnni.plus_outliers16(y, n0, count, absmax_w, x_o, cols, J, w.reshape(-1), n0 * w.shape[1], w.shape[1], 4)

    @njit
    def scalar(y, n0, count, absmax_w, x_o, cols, J, w):
        for n in range(n0, n0 + count):
            y[n] = _plus_outliers(y[n], 0, n, absmax_w, x_o[:, :J], cols[:J], w)

    N, K = 40, 23
    n0 = 19 if where == "middle" else N - count  # outputs after the group, or the group ending at the last row
    w = rng.integers(-127, 128, (N, K), dtype=np.int8)
    absmax_w = rng.uniform(0.01, 3.0, N).astype(np.float32)
    x_o = (rng.standard_normal((1, K)) * 20).astype(np.float32)
    cols = rng.permutation(K).astype(np.int64)
    stored = rng.standard_normal(N + 16).astype(np.float32)  # y and 16 values after it, which no lane may write
    expected = stored.copy()
    scalar(expected[:N], n0, count, absmax_w, x_o, cols, J, w)
    vector(stored[:N], n0, count, absmax_w, x_o, cols, J, w)
    assert np.array_equal(stored.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("wrong", [None, "y", "absmax_w", "x_o", "cols", "w"])
@pytest.mark.parametrize("panel", [False, True], ids=["rows", "panel"])
def test_the_outlier_intrinsics_refuse_arrays_of_another_dtype(rng, wrong, panel):
    """The intrinsics read their arrays' bytes as float32, int64 and int8: an array of another dtype is a typing
    error at compile time, not a misread (``wrong=None``: the same call with the right dtypes compiles and runs)."""
    from numba import njit
    from numba.core.errors import TypingError

    from kernels.int8 import _vnni, panels

    args = {"y": rng.standard_normal(32).astype(np.float32), "absmax_w": rng.uniform(0.1, 2, 32).astype(np.float32),
            "x_o": rng.standard_normal((1, 8)).astype(np.float32), "cols": np.arange(8, dtype=np.int64),
            "w": rng.integers(-127, 128, 32 * 8, dtype=np.int8)}
    if wrong is not None:
        args[wrong] = args[wrong].astype(np.float64 if wrong != "w" else np.uint8)
    y, absmax_w, x_o, cols, w = args.values()

    if panel:
        @njit
        def call(y, absmax_w, x_o, cols, w):
            panels.plus_panel_outliers16(y, 0, 16, absmax_w, x_o, cols, 8, w, 0)
    else:
        @njit
        def call(y, absmax_w, x_o, cols, w):
            _vnni.plus_outliers16(y, 0, 16, absmax_w, x_o, cols, 8, w, 0, 8, 4)

    if wrong is None:
        if not _vnni.AVAILABLE:  # (a generic x86-64 target crashed in the compiled call)
            pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: the vpdpbusd path that uses "
                        "the intrinsics does not run here")
        call(y, absmax_w, x_o, cols, w)
    else:
        with pytest.raises(TypingError):
            call(y, absmax_w, x_o, cols, w)


@pytest.mark.parametrize("env, expected", [({"NUMBA_CPU_NAME": "generic"}, False),
                                           ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}, False),
                                           ({"NUMBA_CPU_NAME": "icelake-server",
                                             "NUMBA_CPU_FEATURES": "+avx512f,+avx512bw,+avx512vnni"}, True)])
def test_the_path_follows_numbas_target_cpu(env, expected):
    import os
    import subprocess
    import sys

    code = "from kernels.int8 import _api, _vnni; print(_vnni.AVAILABLE, _api.USE_VNNI)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    assert run.stdout.split() == [str(expected)] * 2


# K below, at and across the 64-byte vector; N below the four rows of a step, not a multiple of four, a quarter's
# prefetch past the range's end
@pytest.mark.parametrize("k, n, n_out", [(1, 1, 0), (63, 3, 2), (64, 4, 0), (130, 5, 1), (577, 37, 3),
                                         (2048, 130, 5)])
@pytest.mark.parametrize("ahead", [0, PREFETCH_ROWS])  # the rows' prefetch off (AMD) and on (other vendors)
def test_the_row_kernel_gemv_equals_the_blocked_gemv(rng, dot_path, k, n, n_out, ahead):
    # Int8Linear on one vector runs kernels.int8.rows.gemv on the calling thread where the rows' prefetch is on
    # (not on AMD), split_gemv elsewhere: the same bits, and the same outlier features
    from kernels.int8 import _api, _numba_cpu, _vnni, rows

    x, w, _ = planted_int8(rng, 1, k, n, n_out)
    weight = Int8Linear.from_float(w).weight
    y_rows, y_blocks = np.empty(n, np.float32), np.empty((1, n), np.float32)
    flags_rows, flags_blocks = np.empty(k, np.bool_), np.empty(k, np.bool_)
    threshold = np.float32(6.0)
    rows.gemv(rows.path_marker(_api.USE_VNNI), x, threshold, weight.w_i8, weight.absmax, weight.w_row_sums, y_rows,
              flags_rows, ahead)
    if _api.USE_VNNI:
        _vnni.split_gemv(x, threshold, weight.w_i8, weight.absmax, weight.w_row_sums, y_blocks, flags_blocks)
    else:
        _numba_cpu.split_gemv(x, threshold, weight.w_i8, weight.absmax, y_blocks, flags_blocks)
    assert np.array_equal(y_rows, y_blocks[0]) and np.array_equal(flags_rows, flags_blocks)
    assert np.flatnonzero(flags_rows).size == n_out


CASES = [(1, 64, 32, 0), (1, 4096, 96, 3), (17, 300, 130, 1), (64, 257, 64, 7), (5, 40, 33, 40)]


@pytest.mark.parametrize("keep_fp16", [False, True])
@pytest.mark.parametrize("m, k, n, n_out", CASES)
def test_split_matmul_equals_the_oracle(rng, dot_path, m, k, n, n_out, keep_fp16):
    x, w, _ = planted_int8(rng, m, k, n, n_out)
    layer = Int8Linear.from_float(w, keep_fp16_weights=keep_fp16)
    y, dims = layer(x, return_outliers=True)
    ref = int8_matmul_reference(x, w, keep_fp16_weights=keep_fp16)
    # the integer part is exact on both sides; what differs is float32 vs float64 in the dequantization and sums
    assert_close(y, ref, np.float32, scale=np.abs(ref).max())
    assert y.dtype == np.float32 and y.shape == (m, n)
    if n_out == 0:  # no activation reaches 6 here: the empty outlier set, a pure int8 product
        assert dims.size == 0 and np.abs(x).max() < 6


@pytest.mark.parametrize("implementation", ["round_to_float16", "round_to_float16_in_software"])
def test_round_to_float16_equals_numpys_conversion(rng, implementation):
    from numba import njit

    from kernels.int8 import _numba_cpu

    if implementation == "round_to_float16" and not _numba_cpu.F16C:
        pytest.skip("the target has no F16C: round_to_float16 is the software rounding, tested beside this")
    round_one = getattr(_numba_cpu, implementation)

    @njit
    def rounded(v):
        out = np.empty_like(v)
        for i in range(v.size):
            out[i] = round_one(v[i])
        return out

    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float32)
    below, above = np.nextafter(finite, -np.inf), np.nextafter(finite, np.inf)
    ordered = np.sort(finite)
    midpoints = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(np.float32)  # exact ties
    sweep = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)  # every exponent, NaNs
    v = np.concatenate([finite, below, above, midpoints, rng.standard_normal(10**5).astype(np.float32) * 1e3,
                        rng.standard_normal(10**5).astype(np.float32) * 1e-6, sweep,
                        np.array([65519.0, 65520.0, -65520.0, 7e4, np.inf, -np.inf, 0.0, -0.0], np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = v.astype(np.float16).astype(np.float32)
    got = rounded(v)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan], expected[~nan])
    payloads = np.array([0x7F800001, 0xFF800FFF, 0x7FC00000, 0x7F801FFF], np.uint32).view(np.float32)
    assert np.isnan(rounded(payloads)).all()  # a NaN whose payload is in the dropped bits is still NaN


@pytest.mark.parametrize("keep_fp16", [False, True])
@pytest.mark.parametrize("m, n_out", [(1, 0), (1, 3), (7, 2), (16, 5)])
def test_the_one_launch_decode_path_equals_the_five_kernel_path(rng, monkeypatch, m, n_out, keep_fp16):
    from kernels.int8 import _api

    x, w, _ = planted_int8(rng, m, 300, 130, n_out)
    layer = Int8Linear.from_float(w, keep_fp16_weights=keep_fp16)
    small, small_dims = layer(x, return_outliers=True)  # M <= SMALL_M: one Numba launch
    monkeypatch.setattr(_api, "SMALL_M", 0)  # every M through the five kernels
    large, large_dims = layer(x, return_outliers=True)
    assert np.array_equal(small_dims, large_dims)
    np.testing.assert_allclose(small, large, rtol=1e-6, atol=1e-6 * np.abs(large).max())


@njit
def _outlier_columns_of(x, threshold, flags, cols):  # the inlined step, callable from Python
    return _outlier_columns(x, threshold, flags, cols)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k", [1, 7, 8, 9, 63, 576, 1537])
@pytest.mark.parametrize("where", ["none", "first", "last", "random", "every"])
def test_the_outlier_columns_are_numpys_in_order(rng, m, k, where):
    x = rng.uniform(-5.0, 5.0, (m, k)).astype(np.float32)
    hot = {"none": [], "first": [0], "last": [k - 1], "random": rng.choice(k, min(k, 9), replace=False),
           "every": np.arange(k)}[where]
    for c in hot:
        x[rng.integers(m), c] = rng.choice([-1.0, 1.0]) * rng.uniform(6.0, 60.0)  # in one row of the m
    x[rng.integers(m), k // 2] = np.nan if where == "none" else x[0, k // 2]  # a NaN is no outlier
    flags, cols = np.ones(k, bool), np.full(k, -1, np.int64)
    J = _outlier_columns_of(x, np.float32(6.0), flags, cols)
    expected = (np.abs(x) >= 6.0).any(axis=0)
    assert np.array_equal(flags, expected)
    assert J == expected.sum() and np.array_equal(cols[:J], np.flatnonzero(expected))


def test_every_column_an_outlier_runs_only_the_float16_path(rng):
    x, w, _ = planted_int8(rng, 4, 40, 16, 40)
    layer = Int8Linear.from_float(w, keep_fp16_weights=True)
    y, dims = layer(x, return_outliers=True)
    assert dims.tolist() == list(range(40))
    fp16 = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T  # exact sums
    assert_close(y, fp16, np.float32, scale=np.abs(fp16).max())  # float32 sums of 40 terms


def test_threshold_zero_is_plain_vectorwise_int8(rng):
    x, w, _ = planted_int8(rng, 8, 128, 64, 3)
    x_i8, ax = quantize_reference(x, axis=1)  # the oracle's quantizer, one scale per token
    w_i8, aw = quantize_reference(w, axis=1)  # and one per output feature
    plain = (x_i8.astype(np.int64) @ w_i8.T.astype(np.int64)) * np.outer(ax, aw) / 127**2
    assert_close(int8_matmul(x, w, threshold=0), plain, np.float32, scale=np.abs(plain).max())


@pytest.mark.parametrize("n_out", [1, 3, 7])
def test_decomposition_beats_the_baselines(rng, n_out):
    # LLM.int8() §3.2-3.3: with outlier features, per-tensor absmax loses the small values; the decomposition
    # keeps them. Errors are means of |y − x·w| against float64. K = 4096, a 7B model's hidden size: the default
    # path multiplies the outliers (20-60) by int8-rounded weight rows, whose error shrinks as 1/sqrt(K) with
    # w ~ N(0, 1/K), so the margin over the naive baseline grows with K (at K = 1024 and 7 outliers it is ~4.5x).
    x, w, cols = planted_int8(rng, 16, 4096, 256, n_out)
    exact = x.astype(np.float64) @ w.astype(np.float64).T

    def err(y):
        return float(np.abs(y - exact).mean())

    layer = Int8Linear.from_float(w)
    y, dims = layer(x, return_outliers=True)
    split = err(y)
    assert sorted(dims) == sorted(cols)
    naive = err(naive_absmax_matmul(x, w))
    vectorwise = err(int8_matmul(x, w, threshold=0))
    kept = err(Int8Linear.from_float(w, keep_fp16_weights=True)(x))
    assert split <= naive / 5
    assert kept <= naive / 8
    assert split < vectorwise


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 300), st.integers(1, 70), st.integers(0, 5), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_any_shape_matches_the_oracle(m, k, n, n_out, keep_fp16, seed):
    rng = np.random.default_rng(seed)
    x, w, _ = planted_int8(rng, m, k, n, min(n_out, k))
    y = int8_matmul(x, Int8Weight.from_float(w, keep_fp16), threshold=6.0)
    ref = int8_matmul_reference(x, w, keep_fp16_weights=keep_fp16)
    assert_close(y, ref, np.float32, scale=max(1.0, np.abs(ref).max()))


def test_batched_input_bias_and_storage(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = rng.standard_normal((48, 64)).astype(np.float32)  # (out, in)
    bias = rng.standard_normal(48).astype(np.float32)
    layer = Int8Linear.from_float(w, bias)
    y = layer(x)
    assert y.shape == (2, 3, 48)
    ref = int8_matmul_reference(x, w) + bias
    assert_close(y, ref, np.float32, scale=np.abs(ref).max())
    assert layer.nbytes == 64 * 48 + 3 * 4 * 48  # int8 weights; float32 scales, int32 row sums, float32 bias
    assert Int8Linear.from_float(w, keep_fp16_weights=True).nbytes == 64 * 48 * 3 + 2 * 4 * 48
    assert layer.in_features == 64 and layer.out_features == 48


@pytest.mark.parametrize("name, exc, pattern, make", BAD_INT8_CALLS, ids=[b[0] for b in BAD_INT8_CALLS])
def test_bad_input_is_named(rng, name, exc, pattern, make):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((8, 64)).astype(np.float32)  # (out, in)
    args, kwargs = make(x, w)
    with pytest.raises(exc, match=pattern):
        int8_matmul(*args, **kwargs)
    if not kwargs:  # the layer and the baseline reject the same input alike
        with pytest.raises(exc, match=pattern):
            if name.startswith("x") or name == "k-mismatch":
                Int8Linear.from_float(w)(args[0])
            else:
                Int8Linear.from_float(args[1])
        with pytest.raises(exc, match=pattern):
            naive_absmax_matmul(*args)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        quantize_vectorwise(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="axis must be an int in"):
        quantize_vectorwise(np.ones((2, 2)), axis=2)
    with pytest.raises(ValueError, match="bias must have shape"):
        Int8Linear.from_float(np.ones((4, 3), np.float32), np.ones(3, np.float32))
    layer = Int8Linear.from_float(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        layer.threshold = -1.0  # checked when set, not only in the constructor
    assert layer.threshold == 6.0


def test_a_square_weight_is_read_as_out_in_like_torch(rng):
    # torch.nn.functional.linear(x, w) = x · wᵀ; a square weight would pass silently in the other layout
    x = rng.standard_normal((3, 32)).astype(np.float32)
    w = rng.standard_normal((32, 32)).astype(np.float32)  # (out, in)
    y = Int8Linear.from_float(w)(x)
    exact_t, exact = x.astype(np.float64) @ w.T, x.astype(np.float64) @ w
    assert np.abs(y - exact_t).max() < 0.05 * np.abs(exact_t).max() < np.abs(y - exact).max()
    assert np.array_equal(int8_matmul(x, w), y)


_ACROSS_TARGETS = """
import sys
import numpy as np
import kernels
from kernels import int8

rng = np.random.default_rng(7)
x = rng.standard_normal((40, 300)).astype(np.float32)
x[:, [3, 77]] *= 30  # two outlier dimensions
w = rng.standard_normal((300, 300)).astype(np.float32)  # square: the test does not depend on the weight layout
out = {"q": int8.quantize_vectorwise(x)[0], "gemm": int8.int8_matmul(x, w)}
for keep in (False, True):
    layer = int8.Int8Linear.from_float(w, keep_fp16_weights=keep)
    out[f"prefill_{keep}"], out[f"decode_{keep}"] = layer(x), layer(x[:3])
np.savez(sys.argv[1], **out)
"""


def test_int8_results_do_not_depend_on_the_cpu_target(tmp_path):
    # The int8 kernels must give the same bits on every x86 CPU: here compiled for the host and for x86-64-v3
    # (AVX2, no AVX-512), a target every AVX2 machine runs. (The fp32 kernels do not: their vectorized sums follow
    # the vector width, and int8's activation rounding turns such last-bit differences into ~0.3% of perplexity.)
    import os
    import platform
    import subprocess
    import sys

    host_flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() != "x86_64" or not all(f" {flag}" in host_flags for flag in ("avx2", "fma", "bmi2")):
        pytest.skip("needs an x86-64 CPU with AVX2, FMA and BMI2 to run code compiled for x86-64-v3")
    results = {}
    for target in ("host", "x86-64-v3"):
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
        if target != "host":
            env["NUMBA_CPU_NAME"] = target
        path = tmp_path / f"{target}.npz"
        subprocess.run([sys.executable, "-c", _ACROSS_TARGETS, str(path)], check=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        results[target] = np.load(path)
    for name in results["host"].files:
        assert np.array_equal(results["host"][name], results["x86-64-v3"][name]), f"{name} differs across targets"


@pytest.mark.parametrize("x, kwargs, pattern", [
    # finite values the int8 path could not represent gave inf outputs or all-zero codes before
    (np.array([[1.0, 2.0, 7e4]], np.float32), {}, "rounds them to inf from 65520"),
    (np.array([[1.0, 2.0, 1e300]]), {"threshold": 0.0}, "beyond float32's range"),
    (np.array([[1e-40, 5e-41, 3e-41]], np.float32), {}, "below float32's normal range"),
    (np.array([[1e-300, 5e-301, 1e-301]]), {"threshold": 0.0}, "below float32's normal range"),
])
def test_finite_values_int8_cannot_represent_are_refused(x, kwargs, pattern):
    w = np.ones((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=pattern):
        int8_matmul(x, w, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        Int8Linear.from_float(w, **kwargs)(x)
    if "65520" not in pattern:  # quantize_vectorwise has no float16 path
        with pytest.raises(ValueError, match=pattern):
            quantize_vectorwise(x)


def test_weights_the_float16_path_cannot_hold_are_refused_where_it_runs(rng):
    # the outlier dimensions' weights are dequantized to float16 on every path: from 65520 on they became inf, and
    # the product inf (NaN where x's outlier value is 0), unless the float16 copy was kept (refused there)
    w = rng.standard_normal((8, 16)).astype(np.float32) * 1e5
    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[:, 2] = 20.0  # an outlier dimension at the default threshold
    for call in (lambda: int8_matmul(x, w), lambda: Int8Linear.from_float(w)(x), lambda: Int8Linear.from_float(w)(x[0]),
                 lambda: int8_matmul(x, Int8Weight.from_float(w))):
        with pytest.raises(ValueError, match="w has values up to .* rounds them to inf from 65520"):
            call()
    y = int8_matmul(x, w, threshold=0.0)  # no float16 path: int8 only
    assert np.isfinite(y).all()


def test_large_values_pass_without_the_float16_path():
    # threshold 0: no outlier dimension, no float16, so 70000 is an ordinary int8-quantized value
    x = np.array([[1.0, 2.0, 7e4]], np.float32)
    w = np.eye(3, dtype=np.float32)
    assert np.allclose(int8_matmul(x, w, threshold=0.0), x, rtol=0.01, atol=300)
    # nor below a threshold above it: 70000 is no outlier at 1e5 (it was refused for any threshold > 0)
    for call in (lambda: int8_matmul(x, w, threshold=1e5), lambda: Int8Linear.from_float(w, threshold=1e5)(x)):
        assert np.array_equal(call(), int8_matmul(x, w, threshold=0.0))
    with pytest.raises(ValueError, match="rounds them to inf"):  # an outlier from 7e4 on: through float16
        int8_matmul(x, w, threshold=7e4)
    with pytest.raises(ValueError, match="rounds them to inf"):
        Int8Weight.from_float(np.array([[7e4, 1.0]], np.float32), keep_fp16_weights=True)


def test_work_that_would_not_fit_is_refused_before_it_starts(rng, monkeypatch):
    # int8_gemm, int8_matmul and Int8Linear had no memory check: a result larger than the machine's memory began
    # and failed in NumPy's allocation, or swapped
    from kernels._common import memory

    x = rng.standard_normal((64, 32)).astype(np.float32)
    w = rng.standard_normal((48, 32)).astype(np.float32)
    x_i8, w_i8 = (rng.integers(-127, 128, a.shape, dtype=np.int8) for a in (x, w))
    monkeypatch.setattr(memory, "MIN_CHECKED_BYTES", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda: 4 * 64 * 48)  # the result alone fits, not its work
    for call, what in ((lambda: int8_gemm(x_i8, w_i8), r"int8_gemm's \(64, 48\) int32 result"),
                       (lambda: int8_matmul(x, w), r"int8_matmul's \(64, 48\) result"),
                       (lambda: Int8Linear.from_float(w)(x), r"int8_matmul's \(64, 48\) result")):
        with pytest.raises(kernels.InsufficientMemoryError, match=what + ".* needs .* GiB"):
            call()
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**30)
    assert np.array_equal(int8_gemm(x_i8, w_i8), x_i8.astype(np.int64) @ w_i8.T.astype(np.int64))
