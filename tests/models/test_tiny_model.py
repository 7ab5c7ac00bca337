"""The model code on a tiny random-weight configuration: no download, fast."""
from __future__ import annotations

import numpy as np
import pytest

from kernels import decode
from kernels.decode._layout import TASKS_PER_THREAD
from models import ModelConfig
from models.smollm2 import SmolLM2, cache_policy

from tests.helpers import HUGE_PAGES, NO_HUGE_PAGES, vm_flags

TINY = ModelConfig("tiny", "llama", n_layers=2, hidden=32, intermediate=64, n_heads=4, n_kv_heads=2, vocab=50,
                   tied_embeddings=True, rope_base=100000.0)


def tiny_weights(rng):
    c = TINY
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"token_embd.weight": (c.vocab, c.hidden), "output_norm.weight": (c.hidden,)}
    for i in range(c.n_layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (c.hidden,), p + "ffn_norm.weight": (c.hidden,),
                       p + "attn_q.weight": (q_out, c.hidden), p + "attn_k.weight": (kv_out, c.hidden),
                       p + "attn_v.weight": (kv_out, c.hidden), p + "attn_output.weight": (c.hidden, q_out),
                       p + "ffn_gate.weight": (c.intermediate, c.hidden),
                       p + "ffn_up.weight": (c.intermediate, c.hidden),
                       p + "ffn_down.weight": (c.hidden, c.intermediate)})
    return TINY, {name: (rng.standard_normal(shape) * 0.3 + (1.0 if "norm" in name else 0.0)).astype(np.float32)
                  for name, shape in shapes.items()}


@pytest.fixture
def model(rng):
    return SmolLM2(weights=tiny_weights(rng))


def test_shapes_and_cache_consistency(model, rng):
    ids = rng.integers(0, 50, 23).tolist()
    full = model.forward(ids, model.new_cache(), 0)
    assert full.shape == (23, 50) and np.isfinite(full).all()
    cache = model.new_cache()
    steps = [model.forward(ids[:9], cache, 0)] + [model.forward([t], cache, 9 + i) for i, t in enumerate(ids[9:])]
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=1e-4, atol=1e-4 * np.abs(full).max())
    assert all(kv[0].shape == (2, 23, 8) for kv in cache)


def test_rotary_positions_matter(model, rng):
    # the same token at two positions must give different keys: rotary embeddings are applied
    q = rng.standard_normal((4, 1, 8)).astype(np.float32)
    assert not np.allclose(model._rope(q, np.array([0.0])), model._rope(q, np.array([5.0])))
    np.testing.assert_allclose(np.linalg.norm(model._rope(q, np.array([5.0])), axis=-1),
                               np.linalg.norm(q, axis=-1), rtol=1e-5)  # a rotation keeps lengths


def test_switches_run(rng):
    weights = tiny_weights(rng)
    ids = rng.integers(0, 50, 40).tolist()
    fp32 = SmolLM2(weights=weights).forward(ids, SmolLM2(weights=weights).new_cache(), 0)
    for linear in ("int8", "naive-int8"):
        m = SmolLM2(weights=weights, linear=linear)
        logits = m.forward(ids, m.new_cache(), 0)
        assert logits.shape == fp32.shape and np.isfinite(logits).all()
    m = SmolLM2(weights=weights, attention="standard")
    np.testing.assert_allclose(m.forward(ids, m.new_cache(), 0), fp32, rtol=1e-4, atol=1e-4 * np.abs(fp32).max())
    out = SmolLM2(weights=weights).generate(ids, 5, policy=cache_policy("snapkv", capacity=16, window=4))
    assert len(out) == 5 and all(0 <= t < 50 for t in out)


@pytest.mark.parametrize("linear", ["fp32", "int8"])
def test_the_lean_decode_step_equals_the_general_forward(rng, linear):
    model = SmolLM2(weights=tiny_weights(rng), linear=linear)
    ids = rng.integers(0, 50, 20).tolist()
    logits = {}
    for lean in (True, False):
        model.lean_decode = lean
        cache = model.new_cache(8)  # grown by doubling on the way
        logits[lean] = np.concatenate([model.forward(ids[:6], cache, 0)]
                                      + [model.forward([t], cache, 6 + i) for i, t in enumerate(ids[6:])])
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5 * np.abs(logits[False]).max())
    model.lean_decode = True
    greedy = model.generate(ids, 8)
    model.lean_decode = False
    assert model.generate(ids, 8) == greedy


def test_the_decode_step_is_tuned_once_when_built_unless_told_not_to(rng, monkeypatch):
    tuned = []
    tune = decode.LlamaDecodeStep.tune_tasks_per_thread
    monkeypatch.setattr(decode.LlamaDecodeStep, "tune_tasks_per_thread",
                        lambda step, *args, **kwargs: tuned.append(step) or tune(step, *args, **kwargs))
    weights = tiny_weights(rng)
    ids = rng.integers(0, 50, 7).tolist()
    model = SmolLM2(weights=weights, linear="int8")
    built = []  # at the prefill of each call: whether the step was there (built before generate's clock starts)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: built.append(bool(model._step)) or
                        forward(*args, **kwargs))
    tokens = model.generate(ids, 4)
    assert model.generate(ids, 4) == tokens and tuned == [model._step] and built == [True, True]
    assert model._step.tasks_per_thread in (1, 2, 4)
    untuned = SmolLM2(weights=weights, linear="int8")
    untuned.tune_decode = False
    assert untuned.generate(ids, 4) == tokens  # no output depends on the count
    assert len(tuned) == 1 and untuned._step.tasks_per_thread == TASKS_PER_THREAD


@pytest.mark.parametrize("linear", ["fp32", "int8"])
def test_greedy_decoding_in_one_loop_gives_the_token_by_token_tokens_and_cache(rng, linear):
    model = SmolLM2(weights=tiny_weights(rng), linear=linear)
    assert model._one_region_step()  # the loop's step: one region for float32 and int8-only layers
    ids = rng.integers(0, 50, 9).tolist()
    caches, answers = [], []
    loops = []
    greedy = model._one_region_step().greedy
    model._one_region_step().greedy = lambda *args, **kwargs: loops.append(1) or greedy(*args, **kwargs)
    for pick in (None, lambda z: int(np.argmax(z))):  # the compiled loop; the same argmax token by token
        cache = model.new_cache(4)  # too small: grown before the loop, doubled on the way token by token
        logits = model.forward(ids, cache, 0)[-1]
        answers.append(model.continue_decoding(logits, cache, len(ids), 12, pick=pick))
        caches.append(cache)
    assert answers[0] == answers[1] and len(answers[0]) == 12 and loops == [1]  # the loop ran, once
    assert caches[0].lengths == caches[1].lengths == [21, 21]
    for (k0, v0), (k1, v1) in zip(caches[0], caches[1]):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)
    model.im_end = answers[0][4]  # a stop token met on the way: the tokens before its first occurrence
    cache = model.new_cache(32)
    stopped = model.continue_decoding(model.forward(ids, cache, 0)[-1], cache, len(ids), 12)
    assert stopped == answers[0][:answers[0].index(model.im_end)]
    assert cache.lengths == [len(ids) + len(stopped)] * 2


def test_decoding_writes_the_static_cache_in_place(model, rng):
    ids = rng.integers(0, 50, 10).tolist()
    cache = model.new_cache(16)
    arrays = list(cache.k) + list(cache.v)
    prefill = model.forward(ids, cache, 0)
    assert len(model.continue_decoding(prefill[-1], cache, 10, 6)) == 6
    assert cache.lengths == [16, 16]
    assert all(a is b for a, b in zip(arrays, list(cache.k) + list(cache.v)))  # written in place, never reallocated
    small, fresh = model.new_cache(4), model.new_cache(16)  # too small for the prompt: grown, the same content
    model.forward(ids, small, 0)
    model.forward(ids, fresh, 0)
    assert small.capacity() >= 10 and small.lengths == [10, 10]
    for layer in range(2):
        np.testing.assert_array_equal(small[layer][0], fresh[layer][0])
        np.testing.assert_array_equal(small[layer][1], fresh[layer][1])


@pytest.mark.parametrize("name, options", [("snapkv", {"capacity": 12, "window": 4}), ("streaming", {"capacity": 12}),
                                           ("h2o", {"capacity": 12})])
def test_policies_compress_into_the_static_cache(model, rng, name, options):
    ids = rng.integers(0, 50, 30).tolist()
    cache, queries = model.new_cache(40), []
    model.forward(ids, cache, 0, queries=queries)
    original = cache.copy()
    arrays = list(cache.k)
    model.compress_cache(cache, queries, cache_policy(name, **options))
    assert cache.lengths == [12, 12] and all(a is b for a, b in zip(arrays, cache.k))
    assert original.lengths == [30, 30]  # the copy keeps the prefill's cache
    for layer in range(2):
        k_c, v_c, _ = cache_policy(name, **options)(queries[layer][None], original[layer][0][None],
                                                   original[layer][1][None])
        np.testing.assert_array_equal(cache[layer][0], k_c[0])
        np.testing.assert_array_equal(cache[layer][1], v_c[0])
    assert len(model.continue_decoding(np.zeros(50, np.float32), cache, 30, 4)) == 4  # decodes on from there


@pytest.mark.parametrize("kwargs, pattern", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),  # sampled the least likely tokens before
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": 0.7, "top_k": 0}, "top_k must be None or an int >= 1"),  # silently ignored before
    ({"temperature": 0.7, "top_p": 0.0}, r"top_p must be None or a number in \(0, 1\]"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
])
def test_bad_sampling_arguments_are_refused(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        model.generate([1, 2, 3], **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("ids, pattern", [([], "non-empty"), ([1, -1], r"token ids must be in \[0, "),
                                          ([10**6], r"token ids must be in \[0, ")])
def test_bad_token_ids_are_refused(model, ids, pattern):
    # a negative id wrapped around the vocabulary before
    with pytest.raises(ValueError, match=pattern):
        model.generate(ids, 2)


@pytest.mark.parametrize("ids, error, pattern", [
    ([5, -1], ValueError, r"token_ids: token ids must be in \[0, 50\)"),  # wrapped around the vocabulary before
    ([5, 50], ValueError, r"token_ids: token ids must be in \[0, 50\)"),
    ([5], ValueError, "at least 2 tokens"),  # ZeroDivisionError before
    ([5.0, 6.0], TypeError, "integer token ids"),
    (5, TypeError, "sequence of token ids"),
])
def test_the_evaluations_refuse_bad_token_ids(model, ids, error, pattern):
    for evaluate in (model.perplexity, model.negative_log_likelihood, model.outlier_statistics):
        if evaluate.__name__ == "outlier_statistics" and pattern == "at least 2 tokens":
            continue  # (one token has statistics)
        with pytest.raises(error, match=pattern):
            evaluate(ids)


def test_forward_refuses_positions_past_the_context(model, monkeypatch):
    monkeypatch.setattr(model, "context_length", 8)
    model.forward([1, 2, 3], model.new_cache(), 5)  # positions 5 .. 7
    for ids, start in (([1, 2, 3], 6), ([1], 8)):
        with pytest.raises(ValueError, match="exceed the model's context of 8 tokens"):
            model.forward(ids, model.new_cache(), start)


def test_sampling_past_the_vocabulary_or_at_a_tiny_temperature(model, rng):
    # top_k above the vocabulary ended in an IndexError; a temperature of 1e-308 in NaN probabilities
    logits = rng.standard_normal(50).astype(np.float32)
    pick = model._pick(logits, 1.0, 10**6, None, np.random.default_rng(0))
    assert pick == model._pick(logits, 1.0, None, None, np.random.default_rng(0))
    for temperature in (1e-308, 5e-324):
        assert model._pick(logits, temperature, None, None, rng) == int(np.argmax(logits))
        assert model._pick(logits, temperature, 3, 0.5, rng) == int(np.argmax(logits))
    assert model.generate([1, 2, 3], 3, temperature=1.0, top_k=10**6) == model.generate([1, 2, 3], 3,
                                                                                        temperature=1.0)


def test_a_growing_cache_keeps_k_and_v_alike():
    # the doubling read K's new capacity before growing V: V became twice K (found by rope_attend's shape check)
    from models.kv_cache import KVCache

    cache = KVCache(2, 3, 4, capacity=4)
    block = np.ones((3, 5, 4), dtype=np.float32)
    cache.append(0, block, 2 * block)
    assert cache.k[0].shape == cache.v[0].shape == (3, 8, 4)
    assert np.array_equal(cache[0][1], 2 * block)


@pytest.mark.skipif(not HUGE_PAGES, reason=NO_HUGE_PAGES)
def test_a_large_cache_lies_on_huge_pages_and_keeps_them_when_it_grows_or_is_copied(rng):
    from kernels._common.memory import HUGE_PAGE_BYTES
    from models.kv_cache import KVCache

    cache = KVCache(2, 3, 64, capacity=1500)  # 2.3 MB each for K and V
    k, v = (rng.standard_normal((3, 1500, 64), dtype=np.float32) for _ in range(2))
    cache.append(1, k, v)
    cache.append(1, k[:, :1], v[:, :1])  # past the capacity: twice the size
    for c in (cache, cache.copy()):
        assert c.capacity() == 3000
        assert np.array_equal(c[1][0][:, :1500], k) and np.array_equal(c[1][1][:, 1500], v[:, 0])
        for a in (c.keys, c.values):
            assert a.ctypes.data % HUGE_PAGE_BYTES == 0 and "hg" in vm_flags(a.ctypes.data)
