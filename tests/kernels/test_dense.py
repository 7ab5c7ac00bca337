"""kernels.dense.matmul_nt: x · wᵀ for weights stored (out, in), Numba GEMV for few rows, BLAS for many."""
from __future__ import annotations

import numpy as np
import pytest

from kernels import dense
from kernels._common import zmm
from kernels.dense import GEMV_ROWS, matmul_nt

from tests.helpers import assert_close, numba_threads

ROW_PATHS = [pytest.param(dense._rows_loop, id="loop"),
             pytest.param(dense._rows_zmm, id="zmm", marks=pytest.mark.skipif(
                 not zmm.AVAILABLE, reason="the zmm path compiles only for a target with AVX-512F"))]


@pytest.mark.parametrize("m", [1, 5, GEMV_ROWS, GEMV_ROWS + 1, 40])
@pytest.mark.parametrize("k, n", [(1, 1), (7, 65), (576, 960), (33, 128)])
def test_equals_the_float64_product(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    y = matmul_nt(x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert y.dtype == np.float32 and y.shape == (m, n)
    # float32 sums of k products: error within k·eps relative to Σ|x||w|
    bound = k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(y - ref) <= bound + 1e-30)


def _product_bound(x, w):
    """float32 sums of K products: error within K·eps relative to Σ|x||w|."""
    return x.shape[-1] * np.finfo(np.float32).eps * (np.abs(w).astype(np.float64) @ np.abs(x).astype(np.float64))


@pytest.mark.parametrize("rows", ROW_PATHS)
@pytest.mark.parametrize("k", [1, 15, 16, 17, 63, 576, 1000])  # K tails of 0..15 floats (a zmm holds 16)
@pytest.mark.parametrize("n0, n1", [(0, 1), (0, 7), (3, 12), (0, 70), (1, 70), (69, 70)])  # quarters and tails
def test_both_row_paths_equal_the_float64_product(rng, rows, k, n0, n1):
    """gemv_rows' two paths over a range of outputs: only y[n0:n1] is written, and the last row's tail, which ends
    the weight array, is read without reading past it."""
    x = rng.standard_normal(k).astype(np.float32)
    w = rng.standard_normal((70, k)).astype(np.float32)
    y = np.full(70, np.nan, dtype=np.float32)
    rows(x, w, y, n0, n1)
    ref = w.astype(np.float64) @ x.astype(np.float64)
    assert np.isnan(y[:n0]).all() and np.isnan(y[n1:]).all()
    assert np.all(np.abs(y[n0:n1] - ref[n0:n1]) <= _product_bound(x, w)[n0:n1] + 1e-30)


def test_gemv_rows_takes_the_zmm_path_where_the_target_has_avx512f():
    assert dense.gemv_rows is (dense._rows_zmm if zmm.AVAILABLE else dense._rows_loop)


def test_mismatched_k_is_refused(rng):
    with pytest.raises(ValueError, match=r"x \(M, K\) and w \(N, K\) must share a K"):
        matmul_nt(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))


@pytest.mark.parametrize("transpose_b", [False, True])
def test_batched_matmul_writes_into_the_array_given(rng, transpose_b):
    from kernels._common.blas import batched_matmul

    a = rng.standard_normal((3, 5, 7)).astype(np.float32)
    b = rng.standard_normal((3, 9, 7) if transpose_b else (3, 7, 9)).astype(np.float32)
    buffer = np.full((2, 3, 5, 9), np.nan, dtype=np.float32)
    y = batched_matmul(a, b, transpose_b=transpose_b, out=buffer[1])
    assert np.shares_memory(y, buffer) and np.isnan(buffer[0]).all()
    ref = a.astype(np.float64) @ (np.swapaxes(b, 1, 2) if transpose_b else b).astype(np.float64)
    np.testing.assert_allclose(buffer[1], ref, rtol=1e-5, atol=1e-5)
    for bad in (np.empty((3, 5, 8), np.float32), np.empty((3, 5, 9), np.float64),
                np.empty((3, 5, 18), np.float32)[:, :, ::2]):
        with pytest.raises(ValueError, match="out must be a C-contiguous float32 array of shape"):
            batched_matmul(a, b, transpose_b=transpose_b, out=bad)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("g, m, n, k", [(1, 1, 1, 1), (1, 5, 300, 7), (1, 300, 5, 7), (1, 17, 40, 3), (1, 15, 16, 5),
                                        (2, 33, 100, 9), (5, 2, 3, 4), (3, 64, 64, 65), (9, 20, 70, 8),
                                        (1, 256, 1536, 40)])
def test_batched_matmul_equals_the_float64_product(rng, threads, transpose_b, dtype, g, m, n, k):
    """Every block of every matrix computed once, whichever side is split (columns when M < N for a · bᵀ, rows
    otherwise) and however many threads claim the blocks: widths that do not divide the side, one block per matrix
    (G above the tasks wanted), fewer column blocks than threads."""
    from kernels._common.blas import batched_matmul

    a = rng.standard_normal((g, m, k)).astype(dtype)
    b = rng.standard_normal((g, n, k) if transpose_b else (g, k, n)).astype(dtype)
    b_kn = np.swapaxes(b, 1, 2) if transpose_b else b  # (g, k, n)
    with numba_threads(threads):
        y = batched_matmul(a, b, transpose_b=transpose_b)
    ref = a.astype(np.float64) @ b_kn.astype(np.float64)  # (g, m, n)
    assert y.dtype == dtype
    assert_close(y, ref, dtype, scale=np.abs(ref).max())


GUARDED_READ = """
import ctypes, mmap, sys
import numpy as np
from kernels import dense
page = mmap.PAGESIZE
region = mmap.mmap(-1, 2 * page)  # the weight ends where the second page, made unreadable, begins
libc = ctypes.CDLL(None, use_errno=True)
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
assert libc.mprotect(ctypes.c_void_p(address + page), page, 0) == 0  # PROT_NONE
k, n = 17, int(sys.argv[2])
w = np.frombuffer(region, dtype=np.float32, count=n * k, offset=page - 4 * n * k).reshape(n, k)
w[:] = np.arange(n * k, dtype=np.float32).reshape(n, k) / 100
x = np.linspace(-1, 1, k, dtype=np.float32)
y = np.empty(n, dtype=np.float32)
getattr(dense, sys.argv[1])(x, w, y, 0, n)
print(np.abs(y - w.astype(np.float64) @ x).max())
"""


@pytest.mark.parametrize("rows", ["_rows_loop", pytest.param("_rows_zmm", marks=pytest.mark.skipif(
    not zmm.AVAILABLE, reason="the zmm path compiles only for a target with AVX-512F"))])
@pytest.mark.parametrize("n", [4, 5])  # the last row in a group of four, or alone
def test_the_row_tail_reads_nothing_past_the_weight(rows, n):
    """A weight whose last row ends at an unreadable page: a load past its end would kill the process (run apart,
    so that it fails this test, not the session)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", GUARDED_READ, rows, str(n)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 1e-5


def test_a_result_that_would_not_fit_is_refused_before_it_starts(rng, monkeypatch):
    import kernels
    from kernels._common import memory

    x, w = rng.standard_normal((64, 32)), rng.standard_normal((48, 32))  # float64: both copied to float32
    monkeypatch.setattr(memory, "MIN_CHECKED_BYTES", 0)
    predicted = 4 * 64 * 48 + 4 * (x.size + w.size)
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted - 1)
    with pytest.raises(kernels.InsufficientMemoryError, match=rf"\(64, 48\) float32 result .* \({predicted} bytes\)"):
        matmul_nt(x, w)
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted)
    assert_close(matmul_nt(x, w), x @ w.T, np.float32, scale=np.abs(x @ w.T).max())
