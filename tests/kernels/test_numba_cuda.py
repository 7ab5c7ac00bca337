"""The Numba-CUDA tier against the float64 oracles and the CPU tier: attention (flash, split-KV, standard), the
LLM.int8() split matmul, SnapKV. In CI it runs under Numba's CUDA simulator (tests/conftest.py turns it on where
there is no NVIDIA GPU) at tiny sizes; on a machine with a GPU the same tests run on the device at real sizes."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba.cuda", reason="Numba's CUDA target is not installed (pip install -e .[gpu])")

import kernels  # noqa: E402
from kernels import int8, kvprune  # noqa: E402
from kernels._common import gpu as _gpu  # noqa: E402
from kernels.attn import reference  # noqa: E402

from tests.helpers import (BAD_INT8_CALLS, assert_close, attention_inputs, bad_attention_calls,  # noqa: E402
                           plain_attention, planted_int8)

if _gpu.numba_cuda() is None:
    pytest.skip("no CUDA device and NUMBA_ENABLE_CUDASIM is off", allow_module_level=True)

SIM = _gpu.simulated()  # the simulator runs every GPU thread as a Python thread: tiny shapes there
pytestmark = pytest.mark.usefixtures("fast_simulator")  # (tests/conftest.py)
BIG = 1 if SIM else 16  # size multiplier on a real device


def _qkv(rng, B, Hq, Hkv, Nq, Nk, d, dtype):
    q = rng.standard_normal((B, Hq, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    return q, k, v


# (B, Hq, Hkv, Nq, Nk, d, causal, block_q, block_k): N not a multiple of the tile, N smaller than a tile, GQA and
# MQA, causal with Nq < Nk (a chunk against a cache) and Nq > Nk (rows that see no key: zeros, lse −inf)
ATTN_GRID = [
    (1, 2, 2, 9, 9, 8, False, 4, 4),
    (1, 4, 2, 7, 11, 4, True, 4, 3),
    (2, 3, 1, 5, 5, 4, True, 8, 8),
    (1, 2, 1, 6, 3, 4, True, 4, 2),
    (1, 2, 2, 3, 13, 4, False, 2, 5),
]


@pytest.mark.parametrize("algorithm", ["flash", "standard"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("B, Hq, Hkv, Nq, Nk, d, causal, bq, bk", ATTN_GRID)
def test_attention_equals_the_oracle(rng, B, Hq, Hkv, Nq, Nk, d, causal, bq, bk, dtype, algorithm):
    if SIM and algorithm == "standard" and dtype == np.float16:
        pytest.skip("float16 computes in float32: the float32 case covers the simulated kernels")
    q, k, v = _qkv(rng, B, Hq, Hkv, Nq * BIG, Nk * BIG, d * (8 if not SIM else 1), dtype)
    o, lse = kernels.attention(q, k, v, causal=causal, algorithm=algorithm, block_q=bq, block_k=bk,
                               backend="numba-cuda", return_lse=True)
    ref_o, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and o.shape == q.shape
    plain = None
    if dtype == np.float16:  # flash-attn's rule: within 2x the error of attention computed plainly in float16
        plain = plain_attention(q, k, v, causal)
    assert_close(o, ref_o, dtype, plain=plain)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    assert_close(lse[seen], ref_lse[seen], np.float64 if dtype == np.float64 else np.float32)  # compute dtype
    assert not np.isnan(o).any()


@pytest.mark.parametrize("n_splits", [2, 3, 5])
@pytest.mark.parametrize("Nq, causal", [(1, False), (1, True), (3, True)])
def test_split_kv_decode_equals_the_oracle(rng, n_splits, Nq, causal):
    from kernels.attn import _numba_cuda

    q, k, v = _qkv(rng, 1, 3, 1, Nq, 19 * BIG, 4, np.float64)
    dev = [_gpu.to_numba(x) for x in (q, k, v)]
    o, lse = _numba_cuda.flash_forward(*dev, 0.5, causal, block_q=2, block_k=4, n_splits=n_splits)
    ref_o, ref_lse = reference(q, k, v, causal=causal, scale=0.5, return_lse=True)
    assert_close(o.copy_to_host(), ref_o, np.float64)
    assert_close(lse.copy_to_host(), ref_lse, np.float64)


def test_split_count_fills_the_machine():
    from kernels.attn._numba_cuda import split_count

    assert split_count(tasks=9, n_key_tiles=256, multiprocessors=132) == 30  # decode: 9 heads, 264 blocks
    assert split_count(tasks=9, n_key_tiles=4, multiprocessors=132) == 4  # never more than one per key tile
    assert split_count(tasks=1024, n_key_tiles=64, multiprocessors=132) == 1  # prefill fills it already


def test_device_arrays_come_back_on_the_device(rng):
    q, k, v = _qkv(rng, 1, 2, 1, 5, 6, 4, np.float32)
    dev = [_gpu.to_numba(x) for x in (q, k, v)]
    o = kernels.attention(*dev, causal=True, block_q=4, block_k=4)  # "auto" follows the inputs to the device
    assert not isinstance(o, np.ndarray) and _gpu.is_device_array(o)
    assert_close(_gpu.to_host_array(o), reference(q, k, v, causal=True), np.float32)
    with pytest.raises(TypeError, match="backend='cpu' takes NumPy arrays"):
        kernels.attention(*dev, backend="cpu")
    with pytest.raises(TypeError, match="all be NumPy arrays or all device arrays"):
        kernels.attention(q, dev[1], dev[2])


@pytest.mark.parametrize("name, exc, pattern, make", bad_attention_calls(), ids=[c[0] for c in bad_attention_calls()])
def test_the_same_errors_as_the_cpu(rng, name, exc, pattern, make):
    args, kwargs = make(*attention_inputs(rng))
    for backend in ("cpu", "numba-cuda"):
        with pytest.raises(exc, match=pattern):
            kernels.attention(*args, **{"backend": backend, **kwargs})


def test_tiles_beyond_shared_memory_are_refused(rng):
    q, k, v = _qkv(rng, 1, 1, 1, 4, 4, 64, np.float32)
    with pytest.raises(ValueError, match=r"needs 147456 bytes of shared memory per block, above the device's"):
        kernels.attention(q, k, v, block_q=64, block_k=256, backend="numba-cuda")  # (64 + 2·256)·64·4 bytes


# -- LLM.int8() ----------------------------------------------------------------------------------------------------
INT8_GRID = [(1, 9, 5, 0), (3, 10, 7, 1), (6, 17, 4, 2), (2, 8, 9, 8)]  # (M, K, N, outlier dims); 8 of 8: all


@pytest.mark.parametrize("threshold", [6.0, 0.0])
@pytest.mark.parametrize("m, k, n, n_out", INT8_GRID)
def test_int8_matmul_equals_the_cpu_tier_exactly(rng, m, k, n, n_out, threshold):
    x, w, _ = planted_int8(rng, m * BIG, k * BIG, n * BIG, n_out)
    got = int8.int8_matmul(x, w, threshold=threshold, backend="numba-cuda")
    cpu = int8.int8_matmul(x, w, threshold=threshold, backend="cpu")
    assert got.dtype == np.float32 and got.shape == cpu.shape
    # the int8 operands and the int32 product are equal bit for bit; the float16 outlier sums in the same order
    np.testing.assert_allclose(got, cpu, rtol=1e-6, atol=1e-6 * np.abs(cpu).max())
    ref = int8.int8_matmul_reference(x, w, threshold=threshold)
    assert_close(got, ref, np.float32, scale=np.abs(ref).max())


def test_int8_gemm_and_quantizer_are_exact(rng):
    from kernels.int8 import _numba_cuda

    w = rng.standard_normal((6 * BIG, 13 * BIG)).astype(np.float32)  # (out, in)
    w_i8, absmax = _numba_cuda.quantize_weight(_gpu.to_numba(w))
    ref = int8.Int8Weight.from_float(w)
    assert np.array_equal(w_i8.copy_to_host(), ref.w_i8)
    assert np.array_equal(absmax.copy_to_host(), ref.absmax)
    x_i8 = rng.integers(-127, 128, (5, 13 * BIG), dtype=np.int8)
    c = _numba_cuda.gemm(_gpu.to_numba(x_i8), w_i8)
    assert np.array_equal(c.copy_to_host(), int8.int8_gemm(x_i8, ref.w_i8))


def test_int8_with_a_prequantized_weight_and_device_inputs(rng):
    x, w, _ = planted_int8(rng, 3, 12, 5, 2)
    weight = int8.Int8Weight.from_float(w)
    cpu = int8.int8_matmul(x, weight)
    y = int8.int8_matmul(_gpu.to_numba(x), weight)  # "auto": device input, device output
    assert _gpu.is_device_array(y)
    np.testing.assert_allclose(_gpu.to_host_array(y), cpu, rtol=1e-6, atol=1e-6 * np.abs(cpu).max())
    with pytest.raises(ValueError, match="keep_fp16_weights is CPU-only"):
        int8.int8_matmul(x, int8.Int8Weight.from_float(w, keep_fp16_weights=True), backend="numba-cuda")


@pytest.mark.parametrize("name, exc, pattern, make", BAD_INT8_CALLS, ids=[b[0] for b in BAD_INT8_CALLS])
def test_int8_errors_match_the_cpu(rng, name, exc, pattern, make):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((8, 64)).astype(np.float32)  # (out, in)
    args, kwargs = make(x, w)
    for backend in ("cpu", "numba-cuda"):
        with pytest.raises(exc, match=pattern):
            int8.int8_matmul(*args, backend=backend, **kwargs)


def test_int8_nan_on_the_device_is_refused(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    x[1, 2] = np.nan
    w = rng.standard_normal((4, 8)).astype(np.float32)  # (out, in)
    with pytest.raises(ValueError, match="x contains NaN"):
        int8.int8_matmul(_gpu.to_numba(x), _gpu.to_numba(w))


# -- SnapKV --------------------------------------------------------------------------------------------------------
SNAP_GRID = [(4, 2, 30, 12, 4, 3), (2, 1, 25, 10, 3, 5), (3, 3, 19, 9, 2, 1)]  # Hq, Hkv, N, capacity, window, kernel


@pytest.mark.parametrize("gqa", ["mean", "per-query-head"])
@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("hq, hkv, n, capacity, window, kernel_size", SNAP_GRID)
def test_snapkv_kept_sets_equal_the_oracle(rng, hq, hkv, n, capacity, window, kernel_size, pooling, gqa):
    q, k, v = _qkv(rng, 1, hq, hkv, n * BIG, n * BIG, 4, np.float64)
    options = dict(capacity=capacity * BIG, window=window, kernel_size=kernel_size, pooling=pooling, gqa=gqa)
    k_c, v_c, kept = kvprune.snapkv_compress(q, k, v, backend="numba-cuda", **options)
    assert np.array_equal(kept, kvprune.snapkv_kept_reference(q, k, **options))
    k_cpu, v_cpu, kept_cpu = kvprune.snapkv_compress(q, k, v, backend="cpu", **options)
    assert np.array_equal(kept, kept_cpu) and np.array_equal(k_c, k_cpu) and np.array_equal(v_c, v_cpu)
    scores = kvprune.snapkv_scores(q[:, :, -window:], k, kernel_size=kernel_size, pooling=pooling, gqa=gqa,
                                   backend="numba-cuda")
    ref = kvprune.snapkv_scores_reference(q[:, :, -window:], k, kernel_size=kernel_size, pooling=pooling, gqa=gqa)
    assert_close(scores, ref, np.float64)


def test_snapkv_ties_go_to_the_lower_position(rng):
    from kernels.kvprune import _numba_cuda

    scores = rng.integers(0, 3, (1, 2, 20)).astype(np.float64)  # many ties
    k = rng.standard_normal((1, 2, 22, 4))
    for n_keep in (0, 1, 7, 20):
        _, _, kept = _numba_cuda.select_and_gather(_gpu.to_numba(scores), _gpu.to_numba(k), _gpu.to_numba(k),
                                                   n_keep, 2)
        expected = np.concatenate([kvprune.top_positions_reference(scores, n_keep),
                                   np.broadcast_to([20, 21], (1, 2, 2))], axis=-1)
        assert np.array_equal(kept.copy_to_host(), expected)


def test_snapkv_short_prompt_and_device_arrays(rng):
    q, k, v = _qkv(rng, 1, 4, 2, 8, 8, 4, np.float32)
    for gqa, heads in (("mean", 2), ("per-query-head", 4)):
        k_c, v_c, kept = kvprune.snapkv_compress(*(_gpu.to_numba(x) for x in (q, k, v)), capacity=12, window=3,
                                                 gqa=gqa)
        assert _gpu.is_device_array(k_c)
        assert np.array_equal(_gpu.to_host_array(kept), np.broadcast_to(np.arange(8), (1, heads, 8)))
        assert np.array_equal(_gpu.to_host_array(k_c), np.repeat(k, heads // 2, axis=1))
    with pytest.raises(TypeError, match="backend='cpu' takes NumPy arrays"):
        kvprune.snapkv_compress(*(_gpu.to_numba(x) for x in (q, k, v)), capacity=12, window=3, backend="cpu")


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"capacity": 4, "window": 4}, ValueError, "capacity must exceed window"),
    ({"capacity": 10, "window": 2, "kernel_size": 4}, ValueError, "kernel_size must be odd"),
    ({"capacity": 10, "window": 2, "pooling": "sum"}, ValueError, "unknown pooling"),
    ({"capacity": 10, "window": 2, "backend": "tpu"}, ValueError, "unknown backend 'tpu'"),
])
def test_snapkv_errors_match_the_cpu(rng, kwargs, exc, pattern):
    q, k, v = _qkv(rng, 1, 2, 1, 12, 12, 4, np.float32)
    for backend in ("cpu", "numba-cuda"):
        with pytest.raises(exc, match=pattern):
            kvprune.snapkv_compress(q, k, v, **{"backend": backend, **kwargs})


@pytest.mark.parametrize("case", ["nan-q", "nan-k", "nan-v-masked", "-inf-key-tiles", "-inf-everywhere",
                                  "+inf-score", "huge-scale"])
@pytest.mark.parametrize("algorithm, multiprocessors", [("flash", 1), ("flash", 64), ("standard", 1)],
                         ids=["flash-unsplit", "flash-split-kv", "standard"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator runs the kernels' inf − inf in NumPy scalars
def test_nan_inf_and_extreme_scales_follow_the_oracle(rng, monkeypatch, case, algorithm, multiprocessors):
    # the contract of kernels.attention (Notes) on this tier, causal (masked and visible keys): the device's max
    # drops NaN, so NaN is tracked apart; the split count is forced through the multiprocessor count it reads
    from kernels.attn import _numba_cuda
    from tests.kernels.test_attn import _edge_inputs

    monkeypatch.setattr(_numba_cuda, "_multiprocessors", lambda: multiprocessors)
    # 24 keys make three key tiles of 8 for flash; the standard algorithm has no key tiles, and on the simulator
    # each of its S, softmax and PV blocks costs ~0.1 s, so it takes 8
    q, k, v, scale = _edge_inputs(rng, case, 3, (24 if algorithm == "flash" else 8) * BIG)
    if case == "-inf-key-tiles":  # (the CPU case masks 100 keys; here the first half)
        k[..., 0] = rng.standard_normal(k.shape[:-1]).astype(np.float32)
        k[:, :, : k.shape[2] // 2, 0] = -np.inf
    ref, ref_lse = reference(q, k, v, causal=True, scale=scale, return_lse=True)
    blocks = {"block_q": 4, "block_k": 8} if algorithm == "flash" else {}
    o, lse = kernels.attention(q, k, v, causal=True, scale=scale, algorithm=algorithm, backend="numba-cuda",
                               return_lse=True, **blocks)
    assert_close(o, ref, "float32")
    assert_close(lse, ref_lse, "float32", scale=np.abs(ref_lse[np.isfinite(ref_lse)]).max(initial=1.0))


@pytest.mark.parametrize("value, pattern", [(7e4, "rounds them to inf"), (1e-40, "below float32's normal range")])
def test_int8_refuses_what_it_cannot_represent_as_the_cpu_does(rng, value, pattern):
    from numba import cuda

    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[1] = value if value < 1 else x[1]
    x[1, 2] = value
    w = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=pattern):
        int8.int8_matmul(x, w, backend="cpu")
    with pytest.raises(ValueError, match=pattern):
        int8.int8_matmul(cuda.to_device(x), cuda.to_device(w), backend="numba-cuda")
