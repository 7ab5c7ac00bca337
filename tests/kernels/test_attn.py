"""kernels.attention (both algorithms, every input layout) against the float64 oracle kernels.attn.reference."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kernels
from kernels._common import memory as _memory
from kernels.attn import reference
from tests.helpers import TOLERANCES, assert_close, plain_attention

ALGORITHMS = ("flash", "standard")


@dataclass(frozen=True)
class Case:
    Nq: int
    Nk: int
    d: int
    Hq: int = 9
    Hkv: int = 3
    B: int = 1
    dtype: str = "float32"
    causal: bool = False
    block_q: int | None = None
    block_k: int | None = None

    def __str__(self):
        blocks = f"-blk{self.block_q}x{self.block_k}" if self.block_q or self.block_k else ""
        return (f"B{self.B}-H{self.Hq}/{self.Hkv}-Nq{self.Nq}-Nk{self.Nk}-d{self.d}-{self.dtype}"
                f"{'-causal' if self.causal else ''}{blocks}")


def _cases():
    cases = []
    # sequence lengths: self-attention and cross/decode shapes, GQA 9/3, d=64
    for n in (1, 7, 64, 113, 203, 1023, 1024):
        for causal in (False, True):
            cases.append(Case(n, n, 64, causal=causal))
    for nq, nk in ((113, 203), (1, 1024), (1024, 1), (1023, 1024)):
        for causal in (False, True):
            cases.append(Case(nq, nk, 64, causal=causal))
    # head dims, in both full precisions
    for d in (1, 16, 40, 64, 80, 128, 256):
        for dtype in ("float32", "float64"):
            cases.append(Case(113, 113, d, Hq=2, Hkv=2, dtype=dtype, causal=d % 2 == 0))
    # head layouts (GQA, MQA, MHA, batch) in every dtype
    for hq, hkv, b in ((9, 3, 1), (8, 1, 2), (4, 4, 2)):
        for dtype in ("float16", "float32", "float64"):
            for causal in (False, True):
                cases.append(Case(113, 203, 40, Hq=hq, Hkv=hkv, B=b, dtype=dtype, causal=causal))
    # blocks that do not divide N, blocks larger than N, single-row blocks
    for block_q, block_k in ((7, 13), (64, 48), (300, 17), (1, 1), (1, 1024), (1024, 5)):
        for causal in (False, True):
            cases.append(Case(113, 203, 16, dtype="float64", causal=causal, block_q=block_q, block_k=block_k))
            cases.append(Case(203, 113, 16, dtype="float64", causal=causal, block_q=block_q, block_k=block_k))
    return cases


def _inputs(rng, case):
    q = rng.standard_normal((case.B, case.Hq, case.Nq, case.d)).astype(case.dtype)
    k = rng.standard_normal((case.B, case.Hkv, case.Nk, case.d)).astype(case.dtype)
    v = rng.standard_normal((case.B, case.Hkv, case.Nk, case.d)).astype(case.dtype)
    return q, k, v


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", _cases(), ids=str)
def test_matches_oracle(rng, case, algorithm):
    q, k, v = _inputs(rng, case)
    ref_o, ref_lse = reference(q, k, v, causal=case.causal, return_lse=True)
    o, lse = kernels.attention(q, k, v, causal=case.causal, algorithm=algorithm, block_q=case.block_q,
                               block_k=case.block_k, return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.shape == q.shape[:-1]
    plain = plain_attention(q, k, v, case.causal) if case.dtype == "float16" else None
    assert_close(o, ref_o, case.dtype, plain=plain)
    lse_dtype = "float32" if case.dtype == "float16" else case.dtype
    assert_close(lse, ref_lse, lse_dtype)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape_q, shape_kv", [((113, 40), (203, 40)), ((3, 113, 40), (1, 203, 40))],
                         ids=["2d", "3d"])
def test_lower_rank_inputs(rng, algorithm, shape_q, shape_kv):
    q = rng.standard_normal(shape_q).astype(np.float32)
    k, v = (rng.standard_normal(shape_kv).astype(np.float32) for _ in range(2))
    o = kernels.attention(q, k, v, causal=True, algorithm=algorithm)
    assert o.shape == q.shape
    assert_close(o, reference(q, k, v, causal=True), "float32")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_noncontiguous_inputs_are_not_modified(rng, algorithm):
    base = rng.standard_normal((1, 4, 64, 97)).astype(np.float32)
    q = base[..., :48, ::2]  # strided view, (1, 4, 48, 49)
    k = rng.standard_normal((1, 2, 49, 70)).astype(np.float32).swapaxes(-1, -2)  # (1, 2, 70, 49)
    v = np.asfortranarray(rng.standard_normal((1, 2, 70, 49)).astype(np.float32))
    copies = [x.copy() for x in (q, k, v)]
    o = kernels.attention(q, k, v, algorithm=algorithm)
    assert_close(o, reference(q, k, v), "float32")
    for x, c in zip((q, k, v), copies):
        assert np.array_equal(x, c)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_scale(rng, algorithm):
    q, k, v = _inputs(rng, Case(64, 80, 32, dtype="float64"))
    default = kernels.attention(q, k, v, algorithm=algorithm)
    explicit = kernels.attention(q, k, v, algorithm=algorithm, scale=1 / np.sqrt(32))
    np.testing.assert_allclose(default, explicit, rtol=1e-12, atol=1e-14)
    assert_close(kernels.attention(q, k, v, algorithm=algorithm, scale=0.37), reference(q, k, v, scale=0.37),
                 "float64")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_query_that_sees_no_key_gives_zeros(rng, algorithm, dtype):
    # causal with Nq > Nk, bottom-right aligned: query i sees keys j <= i + Nk - Nq, so the first Nq - Nk see none
    nq, nk = 50, 20
    q, k, v = _inputs(rng, Case(nq, nk, 16, Hq=2, Hkv=1, dtype=dtype))
    o, lse = kernels.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    blind = nq - nk
    assert np.all(o[:, :, :blind] == 0)
    assert np.all(np.isneginf(lse[:, :, :blind]))
    assert np.all(np.isfinite(lse[:, :, blind:]))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("where, bad", [("q", np.nan), ("k", np.nan), ("v", np.nan), ("q", np.inf),
                                        ("k", -np.inf)])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_reaches_exactly_the_rows_it_touches(rng, algorithm, where, bad, causal):
    # an inf in q or k makes scores of ±inf, whose softmax is NaN in the oracle too (inf − inf)
    q, k, v = _inputs(rng, Case(70, 90, 16, Hq=4, Hkv=2, dtype="float32"))
    inputs = {"q": q, "k": k, "v": v}
    row = 45
    inputs[where][0, 1, row, 3] = bad
    o = kernels.attention(q, k, v, causal=causal, algorithm=algorithm, block_q=16, block_k=16)
    ref = reference(q, k, v, causal=causal)
    assert np.array_equal(np.isnan(o), np.isnan(ref))
    nan_rows = np.isnan(o).any(axis=-1)
    if where == "q":
        expected = np.zeros_like(nan_rows)
        expected[0, 1, row] = True
    else:
        # kv head 1 serves query heads 2 and 3; with the mask, query i sees key 45 when i + 90 - 70 >= 45
        expected = np.zeros_like(nan_rows)
        expected[0, 2:4, (row - 20 if causal else 0):] = True
        if where == "k" and np.isinf(bad):
            # the score is ±inf: +inf gives inf − inf = NaN, −inf just gives the key zero weight
            expected[0, 2:4] &= q[0, 2:4, :, 3] * bad > 0
    assert np.array_equal(nan_rows, expected)


@pytest.mark.parametrize("values", ["nan", "+inf", "-inf", "+inf and -inf", "nan and +inf", "nan in q too"])
@pytest.mark.parametrize("nq, nk, causal", [(70, 70, True), (40, 90, True), (90, 40, True), (50, 50, False)])
def test_the_gpu_tiers_repair_of_a_nonfinite_v_matches_the_oracle(rng, values, nq, nk, causal):
    # the CuPy kernels and the CPU standard algorithm run on v with the non-finite values zeroed (a masked weight 0
    # times NaN leaked into rows that do not see the key), then put them back; checked here with NumPy
    from kernels.attn._nonfinite import restore_nonfinite_v

    q = rng.standard_normal((2, 4, nq, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, nk, 16)).astype(np.float32) for _ in range(2))
    key = nk - 7
    if "nan" in values:
        v[1, 0, key, 3] = np.nan
    if "+inf" in values:
        v[1, 0, key - 20, 3] = np.inf
    if "-inf" in values:
        v[1, 0, key - 30 if values == "-inf" else key - 25, 3] = -np.inf
    if values == "nan in q too":
        q[0, 1, nq - 1, 0] = np.nan
    zeroed = np.where(np.isfinite(v), v, 0).astype(np.float32)
    o_zeroed = reference(q, k, zeroed, causal=causal).astype(np.float32)  # what the kernels compute now
    got = restore_nonfinite_v(np, o_zeroed, v, causal)
    ref = reference(q, k, v, causal=causal)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(np.isposinf(got), np.isposinf(ref)) and np.array_equal(np.isneginf(got), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert np.array_equal(got[finite], o_zeroed[finite])  # the rows a non-finite value does not reach: as computed
    assert not finite.all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_gpu_tiers_forward_wrapper_repairs_a_leaking_forward(rng, monkeypatch, dtype, causal):
    # _with_nonfinite_v around a stand-in forward that leaks as the kernels do (P·V as a plain matmul, masked
    # weights 0 times NaN), NumPy standing in for CuPy: the oracle's NaN rows come back, the finite ones unchanged
    from kernels.attn import _cupy as tier2

    monkeypatch.setattr(tier2._cupy, "require_cupy", lambda: np)

    def leaky(q, k, v, scale, causal, dtype):
        qf, kf, vf = (tier2._as_float(x, dtype) for x in (q, k, v))
        s = scale * qf @ np.swapaxes(kf, -1, -2)  # (B, H, Nq, Nk)
        if causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool), s.shape[-1] - s.shape[-2]), s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o = (p / p.sum(axis=-1, keepdims=True)) @ vf  # 0 · NaN = NaN in every row
        return (tier2.to_bfloat16_bits(o) if dtype == "bfloat16" else o.astype(np.float16)), None

    q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype(np.float32) for _ in range(3))
    v[0, 1, 30, 2] = np.nan
    as_input = (lambda x: tier2.to_bfloat16_bits(x)) if dtype == "bfloat16" else (lambda x: x.astype(np.float16))
    o, _ = tier2._with_nonfinite_v(leaky, *(as_input(x) for x in (q, k, v)), 0.25, causal, dtype)
    got = tier2._as_float(o, dtype)
    ref = reference(*(tier2._as_float(as_input(x), dtype) for x in (q, k, v)), causal=causal, scale=0.25)
    assert np.array_equal(np.isnan(got).any(axis=-1), np.isnan(ref).any(axis=-1))
    assert np.isnan(got).any(axis=-1).sum() == (10 if causal else 40)  # rows 30..39 of head 1, or all of head 1
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=2e-2)  # the stand-in's float16/bfloat16 rounding


def _edge_inputs(rng, case, nq, nk):
    """Inputs for the NaN/±inf/extreme-scale contract: (q, k, v, scale)."""
    q = rng.standard_normal((1, 4, nq, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, nk, 16)).astype(np.float32) for _ in range(2))
    scale = None
    if case == "nan-q":
        q[0, 1, nq - 1, 3] = np.nan
    elif case == "nan-k":
        k[0, 1, nk // 3, 3] = np.nan
    elif case == "nan-v":
        v[0, 0, nk // 3, 3] = np.nan
    elif case == "-inf-key-tiles":  # the first 100 keys score -inf: whole tiles and splits with no finite score
        q[..., 0] = np.abs(q[..., 0]) + 0.1
        k[:, :, :100, 0] = -np.inf
    elif case == "-inf-everywhere":  # every score -inf: rows as if fully masked, whose values never reach them
        q[..., 0] = np.abs(q[..., 0]) + 0.1
        k[..., 0] = -np.inf
        v[0, 1, 3, 2] = np.nan
    elif case == "nan-v-masked":  # after the diagonal of most rows: masked for them under causal
        v[0, 0, nk - 2, 3] = np.nan
    elif case == "+inf-score":
        k[0, 0, 7, 0] = np.inf
    elif case == "huge-scale":
        scale = 1e9  # scale · S ~ 1e10: far past exp's range in float32, but the softmax is an exact one-hot
    elif case == "tiny-scale":
        scale = 1e-30
    return q, k, v, scale


EDGE_CASES = ["nan-q", "nan-k", "nan-v", "nan-v-masked", "-inf-key-tiles", "-inf-everywhere", "+inf-score",
              "huge-scale", "tiny-scale"]


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("nq", [1, 3, 70])
@pytest.mark.parametrize("threads", [1, 2, 16], ids=lambda t: f"splits-for-{t}-threads")
@pytest.mark.parametrize("block_k", [None, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_inf_and_extreme_scales_follow_the_oracle(rng, monkeypatch, case, nq, threads, block_k, causal):
    # one contract (kernels.attention, Notes) for every algorithm, tile size and split-KV count: the number of
    # splits follows the thread count, so it is set through it here, not taken from this machine
    from kernels.attn import _api, _numba_cpu

    monkeypatch.setattr(_numba_cpu, "num_threads", lambda: threads)
    monkeypatch.setattr(_api, "SERIAL_MULTIPLY_ADDS", 0)  # planned for that count however small (call_threads)
    q, k, v, scale = _edge_inputs(rng, case, nq, 300)
    ref, ref_lse = reference(q, k, v, causal=causal, scale=scale, return_lse=True)
    for algorithm in ALGORITHMS:
        o, lse = kernels.attention(q, k, v, causal=causal, scale=scale, algorithm=algorithm,
                                   block_k=block_k if algorithm == "flash" else None, return_lse=True)
        assert_close(o, ref, "float32")
        assert_close(lse, ref_lse, "float32", scale=np.abs(ref_lse[np.isfinite(ref_lse)]).max(initial=1.0))


@pytest.mark.parametrize("threads", [1, 2, 16], ids=lambda t: f"splits-for-{t}-threads")
@pytest.mark.parametrize("sign", [1, -1])
def test_a_scale_whose_scores_overflow_keeps_the_exact_softmax_across_splits(rng, monkeypatch, threads, sign):
    # scale · S beyond float32 (scores 8..16, scale 1e38): the split-KV merge weighed the splits by their lse,
    # ±inf each, and gave NaN (inf − inf) or zeros (−inf read as "no key"); one split was right
    from kernels.attn import _api, _numba_cpu

    monkeypatch.setattr(_numba_cpu, "num_threads", lambda: threads)
    monkeypatch.setattr(_api, "SERIAL_MULTIPLY_ADDS", 0)  # planned for that count however small (call_threads)
    q = np.full((1, 2, 1, 8), sign, dtype=np.float32)
    k = rng.uniform(1.0, 2.0, (1, 1, 4096, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 4096, 8)).astype(np.float32)
    ref = reference(q, k, v, scale=1e38)  # one-hot: the value row of the largest (or smallest) score
    for algorithm in ALGORITHMS:
        o, lse = kernels.attention(q, k, v, scale=1e38, algorithm=algorithm, return_lse=True)
        assert_close(o, ref, "float32")
        assert (lse == sign * np.inf).all()  # lse, a value of the scaled scores, overflows float32 (Notes)


def test_float16_returns_float16_with_float32_lse(rng):
    q, k, v = _inputs(rng, Case(33, 33, 16, dtype="float16"))
    o, lse = kernels.attention(q, k, v, return_lse=True)
    assert o.dtype == np.float16 and lse.dtype == np.float32


def test_decode_allocates_no_n_squared(rng):
    # Nq = 1 against a long cache: extra memory must stay O(Nk·d) (the scores of one row), never Nk²
    import tracemalloc

    nk, d = 200_000, 8
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, nk, d)).astype(np.float32) for _ in range(2))
    for algorithm in ALGORITHMS:
        kernels.attention(q, k, v, causal=True, algorithm=algorithm)  # compile outside the trace
        tracemalloc.start()
        o = kernels.attention(q, k, v, causal=True, algorithm=algorithm)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * k.nbytes, f"{algorithm}: decode allocated {peak} bytes"
        assert_close(o, reference(q, k, v, causal=True), "float32")


@pytest.mark.parametrize("q_shape, k_shape, blocks", [
    ((1, 8, 512, 64), (1, 8, 512, 64), (None, None)),
    ((2, 9, 300, 32), (2, 3, 300, 32), (64, 96)),
    ((1, 9, 1, 64), (1, 3, 5000, 64), (None, 128)),  # decode: split-KV partial results
])
@pytest.mark.parametrize("held", [False, True], ids=["whole", "in-parts"])
def test_flash_allocates_what_its_tiles_predict(rng, monkeypatch, q_shape, k_shape, blocks, held):
    # the bound comes from the kernel's own tile sizes and thread count, not from one machine's run; a call beside
    # held cores, in parts on the calling thread (kernels/_common/threads.py, in_parts), within the same bound
    import tracemalloc

    from kernels._common import threads

    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", held)
    monkeypatch.setattr(threads, "_cores_held", lambda: True)
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 1)  # every call, in parts of one (batch, kv head) unit
    monkeypatch.setattr(threads, "PART_MULTIPLY_ADDS", 1)
    q = rng.standard_normal(q_shape, dtype=np.float32)
    k, v = (rng.standard_normal(k_shape, dtype=np.float32) for _ in range(2))
    block_q, block_k = blocks
    kernels.attention(q, k, v, causal=True, block_q=block_q, block_k=block_k)  # compile outside the trace
    predicted = kernels.attn.flash_memory_bytes(q_shape, k_shape, 4, block_q=block_q, block_k=block_k, causal=True)
    tracemalloc.start()
    o = kernels.attention(q, k, v, causal=True, block_q=block_q, block_k=block_k)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert o.nbytes <= peak <= predicted + 64 * 1024  # + bookkeeping of a call (array headers, Python objects)


def test_standard_refuses_what_does_not_fit(rng, monkeypatch):
    q, k, v = _inputs(rng, Case(64, 64, 8, Hq=2, Hkv=2))
    predicted = 2 * 1 * 2 * 64 * 64 * 4 + 64 * 64  # S and P in float32 + the bool mask
    monkeypatch.setattr(_memory, "MIN_CHECKED_BYTES", 0)  # check even this small allocation
    monkeypatch.setattr(_memory, "available_bytes", lambda: predicted - 1)
    with pytest.raises(kernels.InsufficientMemoryError, match=f"{predicted} bytes"):
        kernels.attention(q, k, v, causal=True, algorithm="standard")
    monkeypatch.setattr(_memory, "available_bytes", lambda: predicted)
    kernels.attention(q, k, v, causal=True, algorithm="standard")
    # flash needs no S or P and still runs in what its own tiles need
    flash_bytes = kernels.attn.flash_memory_bytes(q.shape, k.shape, 4)
    monkeypatch.setattr(_memory, "available_bytes", lambda: flash_bytes)
    kernels.attention(q, k, v, causal=True, algorithm="flash")
    # and refuses, before allocating, tiles that would not fit (a SystemError around a MemoryError before)
    monkeypatch.setattr(_memory, "available_bytes", lambda: flash_bytes - 1)
    with pytest.raises(kernels.InsufficientMemoryError, match="choose smaller block_q and block_k"):
        kernels.attention(q, k, v, causal=True, algorithm="flash")


def test_the_copies_of_the_inputs_count_before_they_are_made(rng, monkeypatch):
    # float16 or strided inputs are copied C-contiguous in float32 first: those copies were made before any check
    # (a broadcast view of 64 GiB ended in NumPy's MemoryError, not InsufficientMemoryError)
    q, k, v = _inputs(rng, Case(64, 64, 8, Hq=2, Hkv=2))
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    copies = 3 * q.size * 4
    for algorithm, work in (("flash", kernels.attn.flash_memory_bytes(q.shape, k.shape, 4)),
                            ("standard", 2 * 2 * 64 * 64 * 4 + q.size * 4)):
        monkeypatch.setattr(_memory, "MIN_CHECKED_BYTES", 0)
        monkeypatch.setattr(_memory, "available_bytes", lambda: copies + work - 1)
        with pytest.raises(kernels.InsufficientMemoryError, match=f"copied C-contiguous in float32 needs .*"
                                                                  f"\\({copies + work} bytes\\)"):
            kernels.attention(q16, k16, v16, algorithm=algorithm)
        monkeypatch.setattr(_memory, "available_bytes", lambda: copies + work)
        kernels.attention(q16, k16, v16, algorithm=algorithm)
    monkeypatch.undo()
    huge = np.broadcast_to(np.float32(1.0), (1, 16, 2**20, 1024))  # 64 GiB once copied, three times
    with pytest.raises(kernels.InsufficientMemoryError, match="copied C-contiguous"):
        kernels.attention(huge, huge, huge)


@pytest.mark.parametrize("block_q, block_k", [(np.int16(98), 400), (np.int8(100), None), (np.int8(2), np.int8(3))])
def test_numpy_integer_block_sizes_are_taken_as_ints(rng, block_q, block_k):
    # the tiles' arithmetic ran in the block size's own width: np.int8(100) overflowed, np.int16(98) sized the
    # workspace too small (a SystemError)
    q = rng.standard_normal((1, 1, 98, 4), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, 400, 4), dtype=np.float32) for _ in range(2))
    o = kernels.attention(q, k, v, block_q=block_q, block_k=block_k)
    assert_close(o, reference(q, k, v), np.float32)


def test_default_blocks_follow_the_cache(monkeypatch):
    from kernels.attn import _blocks

    monkeypatch.setattr(_blocks, "l2_bytes", lambda: 1 << 20)
    big = _blocks.default_blocks(64, 4)
    monkeypatch.setattr(_blocks, "l2_bytes", lambda: 1 << 18)
    small = _blocks.default_blocks(64, 4)
    assert big == (256, 256)  # M = 2^20 / 4 / 4 B = 65536 elements, Bc = M / 4d = 256
    assert small == (64, 64)
    assert _blocks.default_blocks(64, 4, group=3)[0] < big[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 7, 16, 33, 512, 1001])
def test_the_integer_row_max_is_the_max_without_nans(rng, dtype, n):
    # the flash kernel's row max (compared as integers, to vectorize) against NumPy's over the row's first n,
    # NaNs left out: NaNs, infinities, zeros of both signs, subnormals and normal values of both signs
    from numba import njit

    from kernels._common.numba_cpu import row_max

    @njit
    def run(s, n, m):
        return row_max(s, n, m)

    info = np.finfo(dtype)
    pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, info.tiny / 4, -info.tiny / 4, info.max,
                     -info.max, 1.0, -1.0], dtype=dtype)
    for trial in range(30):
        s = (rng.standard_normal(n + 5) * 10.0 ** rng.integers(-30, 30)).astype(dtype)  # 5 past n, never read
        s[n:] = info.max
        picks = rng.random(n) < 0.3
        s[:n][picks] = rng.choice(pool, int(picks.sum()))
        if trial % 10 == 9:
            s[:n] = np.nan  # all NaN: m itself
        for m in (-np.inf, 0.5, -3.0):
            finite = s[:n][~np.isnan(s[:n])]
            expected = max(m, finite.max()) if finite.size else m
            got = run(s, n, m)
            assert got == expected and not np.isnan(got), (trial, m, got, expected)


# The exp compiles with its caller's flags: the flash and SnapKV kernels' FASTMATH (vectorized, fused
# multiply-adds, sums reassociated) and plain code's none (scalar). float32 under FASTMATH: the degree-6
# truncation (1.2e-7) plus 8 roundings of 2^-24 (six Horner steps, the range reduction's two) bound it at 6e-7
# relative. float64 under FASTMATH has no such derivation (reassociation may reorder its degree-12 Horner chain;
# 2.8e-15 on the 2-vCPU Xeon): the attention kernels' float64 tests against the oracle (rtol 1e-10) hold it.
@pytest.mark.parametrize("dtype, flags, max_rel_err", [("float32", "plain", 3e-7), ("float32", "fastmath", 6e-7),
                                                       ("float64", "plain", 1e-15)])
def test_vectorized_exp_of_the_flash_kernel(rng, dtype, flags, max_rel_err):
    # the kernel's exp (exponent bits + polynomial) against libm in float64, over the range softmax feeds it:
    # arguments <= 0 against the row max, and up to log(RESCALE_LIMIT) above a stale maximum
    from numba import njit

    from kernels._common.numba_cpu import EXP_MIN_F32, FASTMATH, exp_row
    from kernels.attn._numba_cpu import RESCALE_LIMIT

    @njit(fastmath=FASTMATH if flags == "fastmath" else False)
    def run(s, p, m, c):
        return exp_row(s, p, s.size, m, c)

    top = np.log(RESCALE_LIMIT)
    x = np.concatenate([-rng.uniform(0, 80, 4000), -rng.uniform(0, 1, 4000), rng.uniform(0, top, 1000),
                        [0.0, -1e-30]]).astype(dtype)
    p = np.empty_like(x)
    total = run(x, p, 0.0, 1.0)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(p - exact) / exact
    assert rel.max() <= max_rel_err, f"max relative error {rel.max():.3g}"
    assert abs(total - exact.sum()) <= (1e-5 if dtype == "float32" else 1e-13) * exact.sum()
    # the argument is scale·(s − m), formed in the input's precision: check that both enter
    p2 = np.empty_like(x)
    run(x, p2, 0.5, 2.0)
    argument = ((x - x.dtype.type(0.5)) * x.dtype.type(2.0)).astype(np.float64)
    in_range = argument >= EXP_MIN_F32
    np.testing.assert_allclose(p2[in_range], np.exp(argument[in_range]), rtol=max_rel_err)
    # below the normal range the result is clamped to a negligible exp(EXP_MIN), never garbage or negative
    assert np.all((p2[~in_range] > 0) & (p2[~in_range] <= np.exp(EXP_MIN_F32) * (1 + 1e-6)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("growth", [0.05, 3.0, 40.0])
def test_scores_that_keep_beating_the_running_max(rng, algorithm, dtype, growth):
    # key j is aligned with every query and grows with j, so each key block beats the maximum of the blocks
    # before it (by up to growth·block·d in score units): the flash kernel must move its running maximum (and
    # rescale its state) again and again without overflow
    nq, nk, d = 40, 300, 8
    q = (np.abs(rng.standard_normal((1, 2, nq, d))) + 0.5).astype(dtype)
    base = np.abs(rng.standard_normal((1, 1, nk, d)))
    k = (base * (1 + growth * np.arange(nk))[None, None, :, None] / d).astype(dtype)
    v = rng.standard_normal((1, 1, nk, d)).astype(dtype)
    o, lse = kernels.attention(q, k, v, causal=True, algorithm=algorithm, block_q=16, block_k=32,
                               return_lse=True)
    ref_o, ref_lse = reference(q, k, v, causal=True, return_lse=True)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(lse, ref_lse, rtol=TOLERANCES[np.dtype(dtype)]["rtol"])
    if dtype == "float64":
        assert_close(o, ref_o, dtype)
    else:
        # scores in the hundreds: rounding them to float32 alone moves the softmax by ~|s|·2^-24, beyond the
        # table's tolerance; judge by flash-attn's rule against attention done plainly in float32 instead
        plain_err = np.abs(plain_attention(q, k, v, True) - ref_o).max()
        assert np.abs(o - ref_o).max() <= 2 * plain_err + TOLERANCES[np.dtype(dtype)]["atol"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_keys_or_queries(rng, algorithm):
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    no_keys = np.empty((1, 2, 0, 4), dtype=np.float32)
    o, lse = kernels.attention(q, no_keys, no_keys, algorithm=algorithm, return_lse=True)
    assert np.all(o == 0) and np.all(np.isneginf(lse))  # nothing to attend to: zeros, as a fully masked row
    assert kernels.attention(q[:, :, :0], q, q, algorithm=algorithm).shape == (1, 2, 0, 4)


_FAULTS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import kernels

    # made as float32: freeing a larger temporary (float64 of 2 MiB) would raise glibc's thresholds first
    q, k, v = (np.random.default_rng(0).standard_normal((1, 8, 512, 64), dtype=np.float32) for _ in range(3))
    for _ in range(2):  # the first call's blocks come from mmap; their free raises glibc's thresholds
        kernels.attention(q, k, v, algorithm=sys.argv[1])
    counts = []
    for _ in range(3):  # the fewest of three rounds: a call that faults its buffers in faults in every round
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            kernels.attention(q, k, v, algorithm=sys.argv[1])
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(counts))
""")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="the page-fault count follows glibc's malloc on Linux")
@pytest.mark.parametrize("algorithm", ["standard", "flash"])
def test_repeated_calls_in_a_fresh_process_find_their_memory_mapped(algorithm):
    # S and P of the standard algorithm (2 × 8 MiB here), the flash kernel's tiles (2.4 MiB per worker): one
    # allocation per call below glibc's 32 MiB mmap ceiling, mapped again from the second call on. Allocated as
    # two arrays, or per task, glibc trimmed them and they were faulted in again on every call: 1000 faults per
    # call for S and P, 4100 for the tiles, and at least 8 (2 MiB huge pages) for 16 MiB. The fewest of three rounds
    # of five calls: one round counted 29 faults in a suite run on two workers (stray ones, from the load), where the
    # rounds count 0-1 on their own.
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _FAULTS, algorithm], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip().splitlines()[-1]) < 20  # in 5 calls
