"""The CUDA C tier (tensor cores, via CuPy) against the float64 oracles and the CPU tier. Needs CuPy and a CUDA
device: skipped elsewhere (the CI compiles these kernels instead, tests/kernels/test_cuda_compile.py, and
``python -m simulator gpu-check`` runs them at real sizes on a lent GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from kernels._common import gpu as _gpu

if _gpu.cupy_module() is None or _gpu.simulated():
    pytest.skip("needs CuPy and a CUDA device (NUMBA_ENABLE_CUDASIM off)", allow_module_level=True)

import cupy  # noqa: E402

import kernels  # noqa: E402
from kernels import int8, kvprune  # noqa: E402
from kernels.attn import _cupy as tier2  # noqa: E402
from kernels.attn import reference  # noqa: E402
from kernels.attn import plain_attention as plain_rounded_attention, round_to  # noqa: E402
from tests.helpers import assert_close, plain_attention, planted_int8  # noqa: E402

# (B, Hq, Hkv, Nq, Nk, d, causal): N not a multiple of the 64-row tiles, smaller than one, GQA, Nq != Nk both ways
GRID = [(1, 2, 2, 64, 64, 64, False), (1, 4, 2, 200, 200, 64, True), (2, 3, 1, 17, 300, 128, True),
        (1, 2, 2, 130, 50, 128, True), (1, 2, 1, 1, 1000, 64, False)]


@pytest.mark.parametrize("algorithm", ["flash", "standard"])
@pytest.mark.parametrize("B, Hq, Hkv, Nq, Nk, d, causal", GRID)
def test_float16_attention_within_flash_attn_rule(rng, B, Hq, Hkv, Nq, Nk, d, causal, algorithm):
    q = rng.standard_normal((B, Hq, Nq, d)).astype(np.float16)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(np.float16)
    v = rng.standard_normal((B, Hkv, Nk, d)).astype(np.float16)
    o = kernels.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal, algorithm=algorithm)
    assert isinstance(o, cupy.ndarray) and o.dtype == cupy.float16
    assert_close(cupy.asnumpy(o), reference(q, k, v, causal=causal), np.float16,
                 plain=plain_attention(q, k, v, causal))


def test_bfloat16_bits_round_trip_and_attention(rng):
    q, k, v = (rng.standard_normal((1, 2, 129, 64)).astype(np.float32) for _ in range(3))
    bits = [tier2.to_bfloat16_bits(cupy.asarray(x)) for x in (q, k, v)]
    rounded = [cupy.asnumpy(tier2.from_bfloat16_bits(b)) for b in bits]
    assert all(np.array_equal(r, round_to(x, "bfloat16")) for r, x in zip(rounded, (q, k, v)))  # ties to even
    o_bits, lse = tier2.flash_forward(*bits, 1 / 8, True, dtype="bfloat16")
    o = cupy.asnumpy(tier2.from_bfloat16_bits(o_bits))
    ref, ref_lse = reference(*rounded, causal=True, return_lse=True)
    assert_close(o, ref, "bfloat16", plain=plain_rounded_attention(*rounded, True, "bfloat16"))  # flash-attn's rule
    assert_close(cupy.asnumpy(lse), ref_lse, np.float32)  # the scores and their sums are float32


def test_unsupported_dtype_or_head_dim_is_refused_or_routed(rng):
    q = cupy.asarray(rng.standard_normal((1, 2, 8, 80)).astype(np.float16))
    with pytest.raises(ValueError, match="backend='cupy' takes float16 inputs with head dim 64 or 128"):
        kernels.attention(q, q, q, backend="cupy")
    o = kernels.attention(q, q, q)  # "auto": d = 80 goes to the Numba-CUDA tier
    assert o.shape == q.shape


@pytest.mark.parametrize("m, k, n, n_out", [(1, 64, 32, 0), (17, 300, 130, 2), (64, 1000, 96, 7)])
def test_int8_matmul_equals_the_cpu_tier(rng, m, k, n, n_out):
    x, w, _ = planted_int8(rng, m, k, n, n_out)
    got = cupy.asnumpy(int8.int8_matmul(cupy.asarray(x), cupy.asarray(w), backend="cupy"))
    cpu = int8.int8_matmul(x, w, backend="cpu")
    np.testing.assert_allclose(got, cpu, rtol=1e-6, atol=1e-6 * np.abs(cpu).max())
    layer = int8.Int8Weight.from_float(w, keep_fp16_weights=True)
    np.testing.assert_allclose(int8.int8_matmul(x, layer, backend="cupy"), int8.int8_matmul(x, layer),
                               rtol=1e-6, atol=1e-6 * np.abs(cpu).max())


@pytest.mark.parametrize("gqa", ["mean", "per-query-head"])
@pytest.mark.parametrize("hq, hkv, n, capacity, window", [(4, 2, 700, 100, 16), (2, 2, 3000, 512, 32)])
def test_snapkv_kept_sets_equal_the_oracle(rng, hq, hkv, n, capacity, window, gqa):
    q = rng.standard_normal((1, hq, n, 32)).astype(np.float32)
    k = rng.standard_normal((1, hkv, n, 32)).astype(np.float32)
    v = rng.standard_normal((1, hkv, n, 32)).astype(np.float32)
    k_c, v_c, kept = kvprune.snapkv_compress(q, k, v, capacity=capacity, window=window, gqa=gqa, backend="cupy")
    assert np.array_equal(kept, kvprune.snapkv_kept_reference(q, k, capacity=capacity, window=window, gqa=gqa))
    heads = np.repeat(k, kept.shape[1] // hkv, axis=1)
    assert np.array_equal(k_c, np.take_along_axis(heads, kept[..., None], axis=2))


@pytest.mark.parametrize("Nq, Nk, causal", [(1, 3000, True), (16, 2500, False), (70, 1100, True)])
def test_split_kv_equals_the_unsplit_kernel_and_the_oracle(rng, Nq, Nk, causal):
    q = rng.standard_normal((2, 4, Nq, 64)).astype(np.float16)
    k = rng.standard_normal((2, 2, Nk, 64)).astype(np.float16)
    v = rng.standard_normal((2, 2, Nk, 64)).astype(np.float16)
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    o1, lse1 = tier2.flash_forward(dq, dk, dv, 1 / 8, causal, n_splits=1)
    o7, lse7 = tier2.flash_forward(dq, dk, dv, 1 / 8, causal, n_splits=7)  # 7 does not divide the key tiles
    ref, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    for o in (o1, o7):
        assert_close(cupy.asnumpy(o), ref, np.float16, plain=plain_attention(q, k, v, causal))
    np.testing.assert_allclose(cupy.asnumpy(lse7), ref_lse, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cupy.asnumpy(lse1), ref_lse, rtol=1e-4, atol=1e-4)


def test_batch_times_heads_above_the_grid_y_limit(rng):
    q, k, v = (rng.standard_normal((1, 65600, 8, 64)).astype(np.float16) for _ in range(3))
    o = cupy.asnumpy(kernels.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True))
    assert_close(o, reference(q, k, v, causal=True), np.float16, plain=plain_attention(q, k, v, True))


def test_int8_gemm_rows_above_the_grid_y_limit(rng):
    from kernels.int8 import _cupy as int8_tier2

    M, K, N = 70000, 32, 16
    x_i8 = rng.integers(-127, 128, (M, K), dtype=np.int8)
    w_i8_t = rng.integers(-127, 128, (N, K), dtype=np.int8)
    ones = cupy.ones(M, dtype=cupy.float32)
    _, c = int8_tier2.gemm(cupy.asarray(x_i8), cupy.asarray(w_i8_t), ones, ones[:N], want_int32=True)
    assert np.array_equal(cupy.asnumpy(c), int8.int8_gemm(x_i8, w_i8_t))


def test_bare_launchers_refuse_strided_or_misaligned_arrays(rng):
    q = cupy.asarray(rng.standard_normal((1, 2, 64, 128)).astype(np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        tier2.flash_forward(q[..., ::2], q[..., ::2], q[..., ::2], 1.0, False)
    flat = cupy.asarray(rng.standard_normal(2 * 64 * 64 + 1).astype(np.float16))
    shifted = flat[1:].reshape(1, 2, 64, 64)  # 2 bytes off the allocation's start
    with pytest.raises(ValueError, match="16-byte boundary"):
        tier2.flash_forward(shifted, shifted, shifted, 1.0, False)


def test_select_and_gather_clamps_n_keep_to_the_positions(rng):
    from kernels.kvprune import _cupy as kv_tier2

    scores = cupy.asarray(rng.standard_normal((1, 2, 10)).astype(np.float32))
    k = cupy.asarray(rng.standard_normal((1, 2, 14, 8)).astype(np.float32))
    _, _, kept = kv_tier2.select_and_gather(scores, k, k, n_keep=50, window=4)
    assert np.array_equal(cupy.asnumpy(kept), np.broadcast_to(np.arange(14), (1, 2, 14)))


@pytest.mark.parametrize("hq, hkv, n, window", [(4, 2, 700, 16), (2, 1, 3000, 32)])
def test_snapkv_votes_by_gemm_and_by_the_fused_kernel_match_the_oracle(rng, hq, hkv, n, window):
    from kernels.kvprune import _cupy as kv_tier2

    qw = rng.standard_normal((1, hq, window, 32)).astype(np.float32)
    k = rng.standard_normal((1, hkv, n, 32)).astype(np.float32)
    ref = kvprune.snapkv_scores_reference(qw, k)
    for votes_by in kv_tier2.VOTES:
        got = cupy.asnumpy(kv_tier2.snapkv_scores(cupy.asarray(qw), cupy.asarray(k), 7, "max", "mean", votes_by))
        assert_close(got, ref, np.float32)
