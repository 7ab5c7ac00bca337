"""kernels.kvprune: SnapKV against its float64 oracle, the baselines, bad input, and decode over the pruned cache."""
from __future__ import annotations

import numpy as np
import pytest

import kernels
from kernels import kvprune
from kernels.attn import reference
from kernels.kvprune import (snapkv_compress, snapkv_kept_reference, snapkv_scores, snapkv_scores_reference,
                             top_positions, top_positions_reference)
from tests.helpers import assert_close


def _prompt(rng, B=1, Hq=4, Hkv=2, N=200, d=16, dtype=np.float64):
    q = rng.standard_normal((B, Hq, N, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, N, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, N, d)).astype(dtype)
    return q, k, v


GRID = [  # (Hq, Hkv, N, capacity, window, kernel_size)
    (4, 4, 200, 60, 16, 7), (9, 3, 257, 100, 32, 5), (8, 1, 130, 50, 8, 1), (6, 2, 64, 63, 62, 3),
    (2, 2, 40, 39, 38, 7),
]


@pytest.mark.parametrize("gqa", ["mean", "per-query-head"])
@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("hq, hkv, n, capacity, window, kernel_size", GRID)
def test_kept_sets_equal_the_oracle(rng, hq, hkv, n, capacity, window, kernel_size, pooling, gqa):
    q, k, v = _prompt(rng, B=2, Hq=hq, Hkv=hkv, N=n)
    k_c, v_c, kept = snapkv_compress(q, k, v, capacity=capacity, window=window, kernel_size=kernel_size,
                                     pooling=pooling, gqa=gqa)
    expected = snapkv_kept_reference(q, k, capacity=capacity, window=window, kernel_size=kernel_size,
                                     pooling=pooling, gqa=gqa)
    assert np.array_equal(kept, expected)
    heads = hkv if gqa == "mean" else hq
    assert k_c.shape == v_c.shape == (2, heads, capacity, 16)
    assert np.all(np.diff(kept, axis=-1) > 0)  # sorted, distinct
    assert np.array_equal(kept[..., -window:], np.broadcast_to(np.arange(n - window, n), kept[..., -window:].shape))
    for cache, full in ((k_c, k), (v_c, v)):
        kv_heads = np.repeat(full, heads // hkv, axis=1)
        assert np.array_equal(cache, np.take_along_axis(kv_heads, kept[..., None], axis=2))


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_scores_equal_the_oracle_in_float32(rng, pooling):
    q, k, _ = _prompt(rng, Hq=9, Hkv=3, N=333, d=64, dtype=np.float32)
    got = snapkv_scores(q[:, :, -32:], k, pooling=pooling)
    assert got.dtype == np.float32
    assert_close(got, snapkv_scores_reference(q[:, :, -32:], k, pooling=pooling), np.float32)


def test_ties_go_to_the_lower_position(rng):
    scores = rng.integers(0, 4, (5, 3, 50)).astype(np.float64)  # many ties
    for n_keep in (0, 1, 7, 25, 49, 50):
        assert np.array_equal(top_positions(scores, n_keep), top_positions_reference(scores, n_keep))


def test_short_prompt_is_returned_unchanged(rng):
    q, k, v = _prompt(rng, Hq=6, Hkv=2, N=40)
    k_c, v_c, kept = snapkv_compress(q, k, v, capacity=40, window=8)
    assert np.array_equal(k_c, k) and np.array_equal(v_c, v)
    assert np.array_equal(kept, np.broadcast_to(np.arange(40), (1, 2, 40)))
    k_c, _, kept = snapkv_compress(q, k, v, capacity=64, window=8, gqa="per-query-head")
    assert k_c.shape == (1, 6, 40, 16) and kept.shape == (1, 6, 40)


def test_decode_over_the_pruned_cache_is_attention_over_the_kept_positions(rng):
    q, k, v = _prompt(rng, Hq=9, Hkv=3, N=300, d=32, dtype=np.float32)
    k_c, v_c, kept = snapkv_compress(q, k, v, capacity=96, window=16)
    q_new = rng.standard_normal((1, 9, 1, 32)).astype(np.float32)
    out = kernels.attention(q_new, k_c, v_c, causal=True)
    restricted = reference(q_new, np.take_along_axis(k, kept[..., None], axis=2),
                           np.take_along_axis(v, kept[..., None], axis=2), causal=True)
    assert_close(out, restricted, np.float32)


def test_baselines(rng):
    q, k, v = _prompt(rng, Hq=4, Hkv=2, N=120)
    _, _, kept = kvprune.streaming_llm(q, k, v, capacity=20, n_sink=4)
    assert kept[0, 0].tolist() == [0, 1, 2, 3] + list(range(104, 120))
    k_c, _, kept = kvprune.h2o(q, k, v, capacity=20)
    scores = kvprune.h2o_scores(q, k)
    assert kept[0, 0, -10:].tolist() == list(range(110, 120))
    assert np.array_equal(kept[..., :10], top_positions_reference(scores[..., :110], 10))
    assert np.array_equal(kvprune.h2o(q, k, v, capacity=20, scores=scores)[2], kept)
    with pytest.raises(ValueError, match="scores must be an ndarray of shape"):
        kvprune.h2o(q, k, v, capacity=20, scores=scores[..., 1:])
    _, _, a = kvprune.uniform_random(q, k, v, capacity=20, seed=3)
    _, _, b = kvprune.uniform_random(q, k, v, capacity=20, seed=3)
    assert np.array_equal(a, b) and np.all(np.diff(a, axis=-1) > 0) and a.shape == (1, 2, 20)


@pytest.mark.parametrize("N, block, Hq, Hkv", [(70, 128, 2, 1), (70, 16, 2, 1), (33, 7, 6, 2), (1, 4, 3, 3),
                                                (129, 64, 4, 4)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_h2o_scores_equal_full_attention_column_sums(rng, N, block, Hq, Hkv, dtype):
    q, k, _ = _prompt(rng, Hq=Hq, Hkv=Hkv, N=N)
    group = Hq // Hkv
    p = np.stack([reference_probabilities(q[0, h], k[0, h // group]) for h in range(Hq)])  # (Hq, N, N)
    expected = p.sum(axis=1).reshape(Hkv, group, N).mean(axis=1)
    got = kvprune.h2o_scores(q.astype(dtype), k.astype(dtype), block=block)
    assert got.dtype == dtype and got.shape == (1, Hkv, N)
    assert_close(got[0], expected, dtype, scale=np.abs(expected).max())  # sums of up to N probabilities


def reference_probabilities(q, k):
    s = q @ k.T / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones_like(s, dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


BAD = [
    ("capacity<=window", ValueError, "capacity must exceed window", {"capacity": 32, "window": 32}),
    ("window-0", ValueError, "window must be >= 1", {"capacity": 10, "window": 0}),
    ("kernel-even", ValueError, "kernel_size must be odd", {"capacity": 50, "kernel_size": 4}),
    ("kernel-0", ValueError, "kernel_size must be >= 1", {"capacity": 50, "kernel_size": 0}),
    ("pooling", ValueError, "unknown pooling 'sum'", {"capacity": 50, "pooling": "sum"}),
    ("gqa", ValueError, "unknown gqa 'max'", {"capacity": 50, "gqa": "max"}),
    ("capacity-float", TypeError, "capacity must be an int", {"capacity": 50.0}),
]


@pytest.mark.parametrize("n", [100, 40], ids=["long", "short"])
@pytest.mark.parametrize("name, exc, pattern, kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named(rng, name, exc, pattern, kwargs, n):
    # the same error whether or not the prompt would have been compressed
    q, k, v = _prompt(rng, N=n)
    kwargs = {"window": 16, **kwargs}
    with pytest.raises(exc, match=pattern):
        snapkv_compress(q, k, v, **kwargs)


@pytest.mark.parametrize("make, pattern", [
    (lambda q, k, v: (q, k, v[..., :8]), "k and v must have the same shape"),
    (lambda q, k, v: (q[:, :3], k, v), "multiple of the number of key/value heads"),
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: (q, k.astype(np.int16), v), "k must have a floating dtype"),
    # more or fewer queries than keys: h2o's kernel wrote out of bounds ("double free or corruption") before
    (lambda q, k, v: (np.concatenate([q, q[:, :, :1]], axis=2), k, v), "of one length N"),
    (lambda q, k, v: (q[:, :, :-1], k, v), "of one length N"),
    (lambda q, k, v: (q[:, :, :, :0], k[..., :0], v[..., :0]), "d >= 1"),
    (lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]), "H >= 1"),
])
def test_bad_shapes_are_named(rng, make, pattern):
    q, k, v = _prompt(rng)
    for fn in (snapkv_compress, kvprune.streaming_llm, kvprune.h2o, kvprune.uniform_random):
        with pytest.raises((ValueError, TypeError), match=pattern):
            fn(*make(q, k, v), capacity=64)
    q_bad, k_bad, v_bad = make(q, k, v)
    if v_bad.shape == k_bad.shape:  # h2o_scores takes no v
        with pytest.raises((ValueError, TypeError), match=pattern):
            kvprune.h2o_scores(q_bad, k_bad)


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_scores_refuse_nan_and_inf(rng, where, bad):
    # a NaN or inf score ranks nothing: before, SnapKV and H2O silently kept the first positions
    q, k, v = _prompt(rng)
    {"q": q, "k": k}[where][0, 1, 17 if where == "k" else -3, 3] = bad  # a prefix key, or a window query
    calls = [lambda: snapkv_compress(q, k, v, capacity=64), lambda: snapkv_scores(q[:, :, -16:], k),
             lambda: kvprune.h2o(q, k, v, capacity=64), lambda: kvprune.h2o_scores(q, k)]
    for call in calls:  # (snapkv_scores calls its queries q_window)
        with pytest.raises(ValueError, match=f"{where}(_window)? contains NaN or ±inf"):
            call()
    kvprune.streaming_llm(q, k, v, capacity=64)  # keeps positions by place, not by score: nothing to refuse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_of_finite_inputs_whose_products_overflow_are_refused(rng, dtype):
    # |q|, |k| ~ 1e19 (float32) or 1e154 (float64): finite inputs, overflowing dot products; before, SnapKV kept
    # positions 0, 1, 2 ... (every score −inf) and H2O ranked NaN
    big = 1e19 if dtype == np.float32 else 1e154
    q, k, v = (x.astype(dtype) for x in _prompt(rng))
    q, k = q * big, k * big
    calls = [lambda: snapkv_compress(q, k, v, capacity=64), lambda: snapkv_scores(q[:, :, -16:], k),
             lambda: kvprune.h2o(q, k, v, capacity=64), lambda: kvprune.h2o_scores(q, k)]
    for call in calls:
        with pytest.raises(ValueError, match=f"dot products overflow {np.dtype(dtype).name}"):
            call()


def test_the_helpers_name_what_they_refuse(rng):
    # top_positions of a 0-d array said "...ndarray...; got ndarray", h2o's scores as a list a ValueError, and
    # uniform_random's bad seeds NumPy's errors, which named no argument
    q, k, v = _prompt(rng)
    with pytest.raises(ValueError, match="scores must have at least one axis"):
        kvprune.top_positions(np.array(1.0), 1)
    with pytest.raises(TypeError, match="scores must be a numpy.ndarray"):
        kvprune.h2o(q, k, v, capacity=64, scores=kvprune.h2o_scores(q, k).tolist())
    with pytest.raises(ValueError, match="seed must be >= 0"):
        kvprune.uniform_random(q, k, v, capacity=64, seed=-1)
    for seed in (1.5, "x", None, True):
        with pytest.raises(TypeError, match="seed must be an int"):
            kvprune.uniform_random(q, k, v, capacity=64, seed=seed)


# (function, input dtype, gqa, input elements copied to the compute dtype, scores held throughout, scores made after
# the kernel, rows of each task's block of S) at B = 2, Hq = 6, Hkv = 2, N = 200, d = 16, window 8, H2O block 32
SCORING_CASES = [
    ("snapkv_scores", np.float16, "mean", 2 * 6 * 8 * 16 + 2 * 2 * 200 * 16, 2 * 6 * 192, 2 * 6 * 192 + 2 * 2 * 192, 8),
    ("snapkv_scores", np.float32, "per-query-head", 0, 2 * 6 * 192, 2 * 6 * 192, 8),
    ("h2o_scores", np.float16, "mean", 2 * 6 * 200 * 16 + 2 * 2 * 200 * 16, 2 * 6 * 200, 2 * 2 * 200, 32),
    ("h2o_scores", np.float32, "mean", 0, 2 * 6 * 200, 2 * 2 * 200, 32),
]


@pytest.mark.parametrize("which, dtype, gqa, copied, held, later, rows", SCORING_CASES)
def test_scores_that_would_not_fit_are_refused_before_the_scoring_allocates(rng, monkeypatch, which, dtype, gqa,
                                                                            copied, held, later, rows):
    # the float32 copies of float16 q and k (none of C-contiguous float32 ones), the scores and, at the kernel's peak,
    # each running task's block of S or else the pooled/averaged scores made after it
    import numba

    from kernels._common import memory

    B, Hq, Hkv, N, d, w = 2, 6, 2, 200, 16, 8
    q, k, _ = _prompt(rng, B=B, Hq=Hq, Hkv=Hkv, N=N, d=d, dtype=dtype)
    if which == "snapkv_scores":
        q_in = np.ascontiguousarray(q[:, :, N - w:])
        call = lambda: kvprune.snapkv_scores(q_in, k, gqa=gqa)  # noqa: E731
    else:
        call = lambda: kvprune.h2o_scores(q, k, block=rows)  # noqa: E731
    running = min(numba.get_num_threads(), B * Hq)  # tasks run one per thread at a time
    predicted = (copied + held + max(running * rows * N, later)) * 4
    monkeypatch.setattr(memory, "MIN_CHECKED_BYTES", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted - 1)
    with pytest.raises(kernels.InsufficientMemoryError, match=rf"{which} on the CPU .* needs .*\({predicted} bytes"):
        call()
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted)
    assert np.isfinite(call()).all()


def test_a_kept_cache_that_would_not_fit_is_refused_before_it_is_made(rng, monkeypatch):
    # the per-query-head cache is group times the kv heads' (and was made from k and v repeated group times)
    from kernels._common import memory

    q, k, v = _prompt(rng, Hq=6, Hkv=2, N=200, dtype=np.float32)
    predicted = 2 * 1 * 6 * 64 * 16 * 4  # 2 × (B, Hq, capacity, d) float32
    monkeypatch.setattr(memory, "MIN_CHECKED_BYTES", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted - 1)
    refused = rf"\(1, 6, 64, 16\) in float32 needs .*\({predicted} bytes"
    with pytest.raises(kernels.InsufficientMemoryError, match=refused):
        snapkv_compress(q, k, v, capacity=64, window=8, gqa="per-query-head")
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted)
    snapkv_compress(q, k, v, capacity=64, window=8, gqa="per-query-head")
