"""kernels.dense.matmul_nt: x · wᵀ for weights stored (out, in), Numba GEMV for few rows, BLAS for many."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.dense import GEMV_ROWS, matmul_nt


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
