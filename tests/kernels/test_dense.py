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
