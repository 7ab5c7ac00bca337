"""kernels.decode.LlamaDecodeStep (a whole token in one parallel region) against the per-layer path built from the
public pieces (add_rms_norm, rope_attend, swiglu, the linear layers) — bit for bit in int8 on either product path,
within float32 tolerance in float32 — over awkward sizes and thread counts; and the pieces it is made of."""
from __future__ import annotations

import types

import numba
import numpy as np
import pytest
from numba import njit, prange

from kernels import decode
from kernels.decode import _step
from kernels.decode._fused import PIECE_SLOTS
from kernels._common.atomics import COUNTER_STRIDE, atomic_add, atomic_load, claim, wait_until
from kernels._common.memory import HUGE_PAGE_BYTES, InsufficientMemoryError
from kernels._common.prefetch import PREFETCH_ROWS, row_prefetch_rows
from kernels.dense import matmul_nt
from kernels.int8 import Int8Linear, _api, _vnni, panels
from kernels.int8.rows import int8_rows, padded_k, path_marker, prepare

from tests.helpers import HUGE_PAGES, NO_HUGE_PAGES, assert_close, numba_threads, vm_flags

PATHS = ["loop"] + (["vnni"] if _vnni.AVAILABLE else [])


@pytest.fixture(params=PATHS)
def int8_path(request, monkeypatch):
    """The int8 products' path, and the layout of the step's int8 weights that goes with it on a machine
    (``kernels.int8.panels.PANELS``): rows for the portable loop, panels for vpdpbusd."""
    monkeypatch.setattr(_api, "USE_VNNI", request.param == "vnni")
    monkeypatch.setattr(panels, "PANELS", request.param == "vnni")
    return request.param


def _model(rng, L, hq, hkv, d, inter, vocab, int8, int8_head, threshold):
    """Random blocks with a few large input features (so that LLM.int8() finds outliers) and their norms."""
    H = hq * d
    shapes = ((hq + 2 * hkv) * d, H), (H, H), (2 * inter, H), (H, inter)

    def linear(shape, quantized):
        w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        return Int8Linear.from_float(w, threshold=threshold) if quantized else w

    layers = [tuple(linear(s, int8) for s in shapes) for _ in range(L)]
    head = linear((vocab, H), int8_head)
    norms = [rng.uniform(0.5, 2.0, (L, H)).astype(np.float32) for _ in range(2)]
    final = rng.uniform(0.5, 2.0, H).astype(np.float32)
    return layers, norms[0], norms[1], final, head


def _per_layer(layers, attn_norms, ffn_norms, final, head, x, cos, sin, keys, values, slots, d, eps):
    """The per-layer path: the fused serial pieces between the linear layers, as SmolLM2's per-layer decode."""
    def apply(w, v):
        return (w(v[None]) if isinstance(w, Int8Linear) else matmul_nt(v[None], w))[0]

    H = x.size
    h, o = np.empty(H, np.float32), np.empty(H, np.float32)
    delta = np.empty(0, np.float32)
    for i, (wqkv, wo, wgu, wd) in enumerate(layers):
        decode.add_rms_norm(x, delta, attn_norms[i], eps, h)
        decode.rope_attend(apply(wqkv, h), cos, sin, keys[i], values[i], int(slots[i]),
                           np.float32(1.0 / np.sqrt(d)), o)
        decode.add_rms_norm(x, apply(wo, o), ffn_norms[i], eps, h)
        gate_up = apply(wgu, h)
        act = np.empty(gate_up.size // 2, np.float32)
        decode.swiglu(gate_up, act)
        delta = apply(wd, act)
    decode.add_rms_norm(x, delta, final, eps, h)
    return apply(head, h), h


# (L, Hq, Hkv, d, intermediate, vocab): SmolLM2's head shape per block at small scale, MHA, one kv head, a d of 2,
# sizes below and across the 64 outputs of a task (qkv 40, intermediate 70, vocab 1 and 130)
SHAPES = [(2, 3, 1, 8, 70, 130), (1, 2, 2, 2, 5, 1), (3, 4, 2, 16, 64, 200), (2, 9, 3, 4, 96, 65)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-hq{}-hkv{}-d{}-I{}-V{}".format(*s))
@pytest.mark.parametrize("mode", ["fp32", "int8", "int8-head", "fp32-int8-head"])
@pytest.mark.parametrize("threads", [1, 2])
# a kv head's slots in one piece; in two, a whole multiple of PIECE_SLOTS; in up to three
@pytest.mark.parametrize("capacity", [9, 2 * PIECE_SLOTS, 1200])
def test_the_step_equals_the_per_layer_path(rng, int8_path, shape, mode, threads, capacity):
    L, hq, hkv, d, inter, vocab = shape
    int8, int8_head = mode in ("int8", "int8-head"), mode.endswith("int8-head")  # int8 blocks: bit for bit
    layers, attn_norms, ffn_norms, final, head = _model(rng, L, hq, hkv, d, inter, vocab, int8, int8_head, 1.5)
    step = decode.LlamaDecodeStep(layers, attn_norms, ffn_norms, final, head, n_heads=hq, n_kv_heads=hkv,
                                  head_dim=d, eps=1e-5)
    keys = rng.standard_normal((L, hkv, capacity, d)).astype(np.float32)
    values = rng.standard_normal((L, hkv, capacity, d)).astype(np.float32)
    slots = rng.integers(0, capacity, L)  # layers at different lengths, as after a per-layer compression
    slots[0] = 0  # the first token of a layer attends to itself only
    if L > 1 and capacity > PIECE_SLOTS:  # the new token alone in its piece; the last slot of a piece, of the cache
        slots[1] = PIECE_SLOTS if capacity % PIECE_SLOTS else PIECE_SLOTS - 1
        slots[-1] = capacity - 1
    x = (3 * rng.standard_normal(hq * d)).astype(np.float32)
    angles = rng.uniform(0, 2 * np.pi, d // 2)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    x_ref, keys_ref, values_ref = x.copy(), keys.copy(), values.copy()
    logits_ref, h_ref = _per_layer(layers, attn_norms, ffn_norms, final, head, x_ref, cos, sin, keys_ref,
                                   values_ref, slots, d, 1e-5)
    with numba_threads(threads):
        logits = step(x, cos, sin, keys, values, slots)
    if int8:  # the blocks bit for bit; the logits too where the head is int8 (a float32 head's GEMV is another
        # kernel, kernels.dense.gemv_rows, whose sums LLVM orders by the vector width: equal on AVX-512, not AVX2)
        assert np.array_equal(x, x_ref)
        assert np.array_equal(keys, keys_ref) and np.array_equal(values, values_ref)
        if int8_head:
            assert np.array_equal(logits, logits_ref)
        else:
            assert_close(logits, logits_ref.astype(np.float64), np.float32)
    else:
        assert_close(logits, logits_ref.astype(np.float64), np.float32)
        assert_close(x, x_ref.astype(np.float64), np.float32)
        assert_close(keys, keys_ref.astype(np.float64), np.float32)
    _, h_next = _per_layer(layers, attn_norms, ffn_norms, final, head, x_ref, cos, sin, keys_ref, values_ref,
                           slots, d, 1e-5)
    first = logits.copy()
    hidden = step(x, cos, sin, keys, values, slots, logits=False)  # a second token, without the head
    assert_close(hidden, h_next.astype(np.float64), np.float32)
    assert np.array_equal(logits, first)  # a result is the caller's: the next call does not write into it


@pytest.mark.parametrize("tasks_per_thread", [1, 2, 3, 8])
@pytest.mark.parametrize("mode", ["fp32", "int8-head"])
def test_any_count_of_tasks_per_thread_gives_the_default_counts_outputs(rng, int8_path, tasks_per_thread, mode):
    # a linear step's outputs in other counts of tasks than the default (v16), set on a step that has run: the same
    # values bit for bit (a task's outputs are a multiple of 16 but the last, so the rows a row kernel sums alone are
    # a linear's last n mod 4 whatever the count); the int8 ones the per-layer path's as well
    int8 = mode == "int8-head"
    layers, attn_norms, ffn_norms, final, head = _model(rng, 2, 9, 3, 4, 96, 197, int8, int8, 1.5)
    step = decode.LlamaDecodeStep(layers, attn_norms, ffn_norms, final, head, n_heads=9, n_kv_heads=3, head_dim=4,
                                  eps=1e-5)
    keys, values = (rng.standard_normal((2, 3, 40, 4)).astype(np.float32) for _ in range(2))
    x = (3 * rng.standard_normal(36)).astype(np.float32)
    angles = rng.uniform(0, 2 * np.pi, 2)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    slots = np.array([17, 39])
    threads = min(2, numba.config.NUMBA_NUM_THREADS)

    def one_token():  # (logits, x, keys, values) from the same inputs
        outputs = x.copy(), keys.copy(), values.copy()
        with numba_threads(threads):
            return (step(outputs[0], cos, sin, outputs[1], outputs[2], slots), *outputs)

    default = one_token()
    step.tasks_per_thread = tasks_per_thread
    counted = one_token()
    assert set(step._plans) == {(True, threads, 1, n) for n in (_step.TASKS_PER_THREAD, tasks_per_thread)}
    kinds, _, tasks, _, _ = step._plans[(True, threads, 1, tasks_per_thread)]
    if threads == 2:  # the head's 197 outputs: about 2·count tasks of 16k outputs (112, 64, 48, 16; 4 gives 7 of 32)
        assert tasks[kinds == _step.HEAD][0] == {1: 2, 2: 4, 3: 5, 8: 13}[tasks_per_thread]
    assert all(np.array_equal(a, b) for a, b in zip(counted, default))
    x_ref, keys_ref, values_ref = x.copy(), keys.copy(), values.copy()
    logits_ref, _ = _per_layer(layers, attn_norms, ffn_norms, final, head, x_ref, cos, sin, keys_ref, values_ref,
                               slots, 4, 1e-5)
    for a, ref in zip(counted, (logits_ref, x_ref, keys_ref, values_ref)):
        if int8:
            assert np.array_equal(a, ref)
        else:
            assert_close(a, ref.astype(np.float64), np.float32)


@pytest.mark.parametrize("value, error, message", [(0, ValueError, "tasks_per_thread must be >= 1"),
                                                   (-1, ValueError, "tasks_per_thread must be >= 1"),
                                                   (1.5, TypeError, "tasks_per_thread must be an int"),
                                                   (True, TypeError, "tasks_per_thread must be an int"),
                                                   ("4", TypeError, "tasks_per_thread must be an int"),
                                                   (None, TypeError, "tasks_per_thread must be an int")])
def test_a_bad_count_of_tasks_per_thread_is_refused(rng, value, error, message):
    layers, attn_norms, ffn_norms, final, head = _model(rng, 1, 2, 1, 4, 8, 11, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, attn_norms, ffn_norms, final, head, n_heads=2, n_kv_heads=1, head_dim=4,
                                  eps=1e-5)
    step.tasks_per_thread = value
    keys, values = (rng.standard_normal((1, 1, 4, 4)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(error, match=message):
        step(x, np.ones(2, np.float32), np.zeros(2, np.float32), keys, values, [0])
    with pytest.raises(error, match=message):
        step.fixed_seconds(0, calls=1)


def test_calls_from_two_threads_at_once_give_the_serial_results(rng):
    import threading

    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
    inputs = [rng.standard_normal(32).astype(np.float32) for _ in range(2)]
    caches = [rng.standard_normal((2, 2, 2, 4, 8)).astype(np.float32) for _ in range(2)]

    def run(i, results):
        for _ in range(20):
            results.append(step(inputs[i].copy(), cos, sin, caches[i][0].copy(), caches[i][1].copy(), [3, 1]))

    serial = [step(inputs[i].copy(), cos, sin, caches[i][0].copy(), caches[i][1].copy(), [3, 1]) for i in range(2)]
    results = [[], []]
    threads = [threading.Thread(target=run, args=(i, results[i])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(results[i]) == 20 and all(np.array_equal(r, serial[i]) for r in results[i])


@pytest.mark.parametrize("row_prefetch", [0, PREFETCH_ROWS])
@pytest.mark.parametrize("other_layout", [False, True])
def test_the_step_with_outliers_equals_int8_linear_bit_for_bit(rng, monkeypatch, int8_path, row_prefetch,
                                                               other_layout):
    # many outlier features (threshold 0.5) and none (threshold 0): the epilogue's float16 part and its absence;
    # with the int8 products' prefetch off (AMD) and on (other vendors); and in the other layout than the path's
    # (the loop over panels, vpdpbusd over rows)
    if other_layout:
        monkeypatch.setattr(panels, "PANELS", not panels.PANELS)
    for threshold in (0.5, 0.0):
        layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, threshold)
        step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
        assert step.int8_panels == panels.PANELS
        step.row_prefetch = row_prefetch
        keys = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
        values = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
        x = rng.standard_normal(32).astype(np.float32)
        cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
        ref = _per_layer(layers, an, fn, final, head, x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1], 8,
                         1e-5)[0]
        assert np.array_equal(step(x, cos, sin, keys, values, [3, 1]), ref)


def test_a_threshold_set_after_the_step_was_made_is_used_at_the_next_call(rng):
    # the step reads its linears' thresholds at each call, as the per-layer path does
    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, 0.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
    for threshold in (0.5, 0.0, 2.0):
        for linear in [w for block in layers for w in block] + [head]:
            linear.threshold = threshold
        keys, values = (rng.standard_normal((2, 2, 4, 8)).astype(np.float32) for _ in range(2))
        x = (2 * rng.standard_normal(32)).astype(np.float32)
        ref = _per_layer(layers, an, fn, final, head, x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1], 8,
                         1e-5)[0]
        assert np.array_equal(step(x, cos, sin, keys, values, [3, 1]), ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_step_counts_the_outlier_products_its_int8_linears_meet(rng, monkeypatch, threads):
    # per call: each int8 linear's outputs times its input's features of |v| >= threshold (LLM.int8()'s float16 part)
    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    assert step.outlier_products == 0.0  # before the first call
    met, call = [], Int8Linear.__call__

    def counted(linear, v, *args, **kwargs):
        met.append(linear.weight.shape[0] * int(np.sum(np.abs(v) >= linear.threshold)))
        return call(linear, v, *args, **kwargs)

    monkeypatch.setattr(Int8Linear, "__call__", counted)
    cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
    per_call = []
    for token in range(3):
        x = (3 * rng.standard_normal(32)).astype(np.float32)
        keys, values = (rng.standard_normal((2, 2, 4, 8)).astype(np.float32) for _ in range(2))
        before = len(met)
        _per_layer(layers, an, fn, final, head, x.copy(), cos, sin, keys.copy(), values.copy(), [token, 1], 8, 1e-5)
        per_call.append(sum(met[before:]))
        with numba_threads(threads):
            step(x, cos, sin, keys, values, [token, 1])
    assert sum(per_call) > 0  # inputs of scale 3 against a threshold of 1.5 have outliers
    assert step.outlier_products == pytest.approx(np.mean(per_call), rel=1e-12)


def test_the_fixed_part_is_timed_without_touching_the_callers_state(rng):
    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    keys, values = (rng.standard_normal((2, 2, 4, 8)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal(32).astype(np.float32)
    cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
    first = step(x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1])
    products = step.outlier_products
    assert step.fixed_seconds(3) > 0 and step.fixed_seconds(0, calls=1) > 0
    assert step.outlier_products == products  # its calls are not the caller's
    assert np.array_equal(step(x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1]), first)
    for bad, error in ((-1, ValueError), (2.5, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(error, match="context must be"):
            step.fixed_seconds(bad)
    with pytest.raises(ValueError, match="calls"):
        step.fixed_seconds(3, calls=0)


def test_tuning_times_each_count_given_and_leaves_the_callers_state(rng):
    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    keys, values = (rng.standard_normal((2, 2, 4, 8)).astype(np.float32) for _ in range(2))
    x = (3 * rng.standard_normal(32)).astype(np.float32)
    cos, sin = np.ones(4, np.float32), np.zeros(4, np.float32)
    first = step(x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1])
    products, calls = step.outlier_products, step._calls
    medians = step.tune_tasks_per_thread((8, 1, 2, 8), rounds=3, calls=2, context=5)
    assert list(medians) == [8, 1, 2] and all(np.isfinite(s) and s > 0 for s in medians.values())
    assert step.tasks_per_thread in medians  # (which one: the fake clock's test below)
    assert step.tuned_seconds == medians
    assert (step.outlier_products, step._calls) == (products, calls)  # its calls are not the caller's
    assert np.array_equal(step(x.copy(), cos, sin, keys.copy(), values.copy(), [3, 1]), first)


@pytest.mark.parametrize("cheapest", [2, (4, 1)], ids=["two", "a tie of four and one"])
def test_tuning_takes_the_count_whose_calls_took_least(rng, monkeypatch, cheapest):
    # a clock that only the region moves, by an amount set by the plan it runs: the count of the cheapest plan wins,
    # the first in ``counts`` where two cost the same; the counts run in turn, their order reversed every other round
    layers, an, fn, final, head = _model(rng, 2, 4, 2, 8, 40, 77, False, False, 6.0)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)
    cheap = cheapest if isinstance(cheapest, tuple) else (cheapest,)
    with numba_threads(min(2, numba.config.NUMBA_NUM_THREADS)):
        threads = numba.get_num_threads()
        count_of = {int(step._plan_for(True, threads, 1, count)[2].sum()): count for count in (1, 2, 4)}
        assert len(count_of) == 3  # (the model's outputs make three different plans)
        clock, ran = [0.0], []

        def region(n_workers, plan, *args):
            count = count_of[int(plan[2].sum())]
            ran.append(count)
            clock[0] += 1.0 if count in cheap else 2.0 + count
            return 0

        monkeypatch.setattr(step, "_region", region)
        monkeypatch.setattr(_step, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        medians = step.tune_tasks_per_thread((4, 1, 2), rounds=3, calls=2)
    assert step.tasks_per_thread == cheap[0]
    assert medians == {count: 1.0 if count in cheap else 2.0 + count for count in (4, 1, 2)}
    assert ran == [4, 1, 2] + [4, 4, 1, 1, 2, 2] + [2, 2, 1, 1, 4, 4] + [4, 4, 1, 1, 2, 2]  # warm-up, three rounds


@pytest.mark.parametrize("arguments, name, error", [
    ({"counts": ()}, "counts", ValueError), ({"counts": [1, 0]}, "counts", ValueError),
    ({"counts": [1.5]}, "counts", TypeError), ({"counts": "12"}, "counts", TypeError),
    ({"counts": 2}, "counts", TypeError), ({"counts": [True]}, "counts", TypeError),
    ({"counts": np.array(2)}, "counts", TypeError),  # (a sequence's error names the sequence)
    ({"rounds": 0}, "rounds", ValueError), ({"calls": 0}, "calls", ValueError), ({"calls": 2.0}, "calls", TypeError),
    ({"context": -1}, "context", ValueError), ({"rounds": None}, "rounds", TypeError)])
def test_bad_tuning_arguments_are_refused(rng, arguments, name, error):
    layers, an, fn, final, head = _model(rng, 1, 2, 1, 4, 8, 11, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    with pytest.raises(error, match=f"^{name} must be"):
        step.tune_tasks_per_thread(**arguments)
    assert step.tasks_per_thread == _step.TASKS_PER_THREAD and step.tuned_seconds is None


def test_caches_past_the_machines_memory_are_refused_before_timing(rng):
    layers, an, fn, final, head = _model(rng, 1, 2, 1, 4, 8, 11, True, True, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    for timed in (step.fixed_seconds, step.tune_tasks_per_thread):
        for context in (10**12, 2**60):  # (2^60 + 1 slots: an int64 product of the caches' shape would wrap)
            with pytest.raises(InsufficientMemoryError, match=f"caches of {context} tokens per block"):
                timed(context=context)


def test_bad_calls_are_refused(rng):
    layers, an, fn, final, head = _model(rng, 2, 2, 1, 4, 8, 10, False, False, 6.0)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    keys = np.zeros((2, 1, 4, 4), np.float32)
    x, cs = np.ones(8, np.float32), np.ones(2, np.float32)
    with pytest.raises(ValueError, match="slots must be"):
        step(x, cs, cs, keys, keys.copy(), [4, 0])  # past the capacity: wrote out of bounds without the check
    with pytest.raises(ValueError, match="slots must be"):
        step(x, cs, cs, keys, keys.copy(), [0])
    with pytest.raises(ValueError, match="keys must be"):
        step(x, cs, cs, keys[:, :, :, :2].copy(), keys[:, :, :, :2].copy(), [0, 0])
    with pytest.raises(ValueError, match="keys and values must have one shape"):
        step(x, cs, cs, keys, np.zeros((2, 1, 5, 4), np.float32), [0, 0])
    with pytest.raises(ValueError, match="x must be"):
        step(np.ones(7, np.float32), cs, cs, keys, keys.copy(), [0, 0])
    with pytest.raises(ValueError, match="cos must be"):
        step(x, np.ones(3, np.float32), cs, keys, keys.copy(), [0, 0])
    with pytest.raises(ValueError, match="not finite"):
        step(np.full(8, np.nan, np.float32), cs, cs, keys, keys.copy(), [0, 0])
    with pytest.raises(ValueError, match=r"layers\[1\].wo must be \(out, in\)"):
        bad = [layers[0], (layers[1][0], layers[1][0], *layers[1][2:])]
        decode.LlamaDecodeStep(bad, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    with pytest.raises(TypeError, match="float32 numpy.ndarray or an Int8Linear"):
        bad = [tuple(w.astype(np.float64) for w in block) for block in layers]
        decode.LlamaDecodeStep(bad, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    with pytest.raises(ValueError, match="all float32 arrays or all Int8Linear"):
        mixed = [layers[0], (Int8Linear.from_float(layers[1][0]), *layers[1][1:])]
        decode.LlamaDecodeStep(mixed, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    with pytest.raises(ValueError, match="n_heads must be a multiple"):
        decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=3, head_dim=4, eps=1e-5)
    with pytest.raises(TypeError, match="n_heads must be an int; got float"):
        decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2.0, n_kv_heads=1, head_dim=4, eps=1e-5)
    with pytest.raises(ValueError, match="head_dim must be >= 1; got 0"):
        decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=0, eps=1e-5)
    with pytest.raises(ValueError, match="float16 copy"):
        kept = [tuple(Int8Linear.from_float(w, keep_fp16_weights=True) for w in block) for block in layers]
        decode.LlamaDecodeStep(kept, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("int8", [False, True])
def test_a_result_with_one_value_that_is_not_finite_is_refused(rng, threads, int8):
    layers, an, fn, final, head = _model(rng, 2, 2, 1, 4, 8, 300, int8, False, 6.0)
    kwargs = dict(n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    x, cs = rng.standard_normal(8).astype(np.float32), np.ones(2, np.float32)
    keys = rng.standard_normal((2, 1, 4, 4)).astype(np.float32)
    with numba_threads(threads):
        h = decode.LlamaDecodeStep(layers, an, fn, final, head, **kwargs)(x.copy(), cs, cs, keys.copy(),
                                                                          keys.copy(), [1, 1], logits=False)
        bad_head = head.copy()
        bad_head[211] = 3e38 * np.sign(h)  # its logit is a sum past float32's range; the other 299 are finite
        step = decode.LlamaDecodeStep(layers, an, fn, final, bad_head, **kwargs)
        with pytest.raises(ValueError, match="produced 1 values that are not finite"):
            step(x.copy(), cs, cs, keys.copy(), keys.copy(), [1, 1])
        assert np.array_equal(step(x.copy(), cs, cs, keys.copy(), keys.copy(), [1, 1], logits=False), h)  # after it
        with pytest.raises(ValueError, match="not finite"):  # the hidden state itself
            step(np.full(8, np.inf, np.float32), cs, cs, keys.copy(), keys.copy(), [1, 1], logits=False)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("logits", [True, False])
def test_an_int8_step_refuses_a_nan_hidden_state(rng, int8_path, threads, logits):
    """Int8 blocks and head: a NaN in x reaches every normed input, whose absmax is then NaN, and so the outputs.
    The row quantization had compared floats and passed over NaN: the inputs quantized to zeros with a scale of 0,
    and the logits came out all finite, and all zero."""
    layers, an, fn, final, head = _model(rng, 2, 2, 1, 4, 8, 10, True, True, 6.0)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    keys, cs = rng.standard_normal((2, 1, 4, 4)).astype(np.float32), np.ones(2, np.float32)
    x = rng.standard_normal(8).astype(np.float32)
    x[3] = np.nan
    with numba_threads(threads), pytest.raises(ValueError, match="not finite"):
        step(x, cs, cs, keys, keys.copy(), [1, 1], logits=logits)


@pytest.mark.parametrize("ahead", [0, PREFETCH_ROWS])  # the row prefetch off (AMD) and on (other vendors)
@pytest.mark.parametrize("span", [7, 37])  # a quarter of one row and three alone; quarters of 9 and one alone
@pytest.mark.parametrize("n, k", [(1, 1), (5, 63), (70, 64), (130, 200)])
def test_prepared_rows_equal_int8_linear(rng, int8_path, n, k, span, ahead):
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = (2 * rng.standard_normal((1, k))).astype(np.float32)
    layer = Int8Linear.from_float(w, threshold=2.5)
    flags, cols = np.empty(k, np.bool_), np.empty(k, np.int64)
    x_o, x_u8, absmax_x = np.empty((1, k), np.float32), np.empty((1, padded_k(k)), np.uint8), np.empty(1, np.float32)
    J = prepare(x, np.float32(2.5), flags, cols, x_o, x_u8, absmax_x)
    y = np.full(n, np.nan, np.float32)
    _rows(path_marker(), x_u8, J, cols, x_o, absmax_x, layer.weight.w_i8, layer.weight.absmax,
          layer.weight.w_row_sums, y, n, span, ahead)
    assert np.array_equal(y, layer(x)[0])


@njit
def _rows(path, x_u8, J, cols, x_o, absmax_x, w, absmax_w, row_sums, y, n, span, ahead):
    for n0 in range(0, n, span):  # in ranges of ``span`` outputs, the last one short
        int8_rows(path, x_u8, J, cols, x_o, absmax_x, w, absmax_w, row_sums, y, n0, min(n, n0 + span), ahead)


@njit(parallel=True)
def _count_in_steps(n_workers, counters, out, n_steps, n_tasks):
    for _ in prange(n_workers):
        for s in range(n_steps):
            while True:
                t = atomic_add(counters, 2 * s * COUNTER_STRIDE, 1)
                if t >= n_tasks:
                    break
                # each task of step s reads what step s - 1 wrote: wrong if a step started before the last ended
                out[s, t] = 1 + (out[s - 1, (t + 1) % n_tasks] if s else 0)
                atomic_add(counters, (2 * s + 1) * COUNTER_STRIDE, 1)
            wait_until(counters, (2 * s + 1) * COUNTER_STRIDE, n_tasks)


def test_the_int8_rows_prefetch_follows_the_vendor():
    # measured on both (kernels/_common/prefetch.py): the hardware alone on AMD, PREFETCH_ROWS ahead elsewhere
    assert row_prefetch_rows("AuthenticAMD") == 0
    assert row_prefetch_rows("GenuineIntel") == row_prefetch_rows("") == PREFETCH_ROWS > 0


@pytest.mark.parametrize("n_workers", [1, 2, 5])
def test_claimed_steps_run_in_order(n_workers):
    n_steps, n_tasks = 50, 7
    counters = np.zeros(2 * n_steps * COUNTER_STRIDE, np.int64)
    out = np.zeros((n_steps, n_tasks), np.int64)
    _count_in_steps(n_workers, counters, out, n_steps, n_tasks)
    assert np.array_equal(out, np.broadcast_to(np.arange(1, n_steps + 1)[:, None], out.shape))
    done = np.array([_load(counters, (2 * s + 1) * COUNTER_STRIDE) for s in range(n_steps)])
    assert np.all(done == n_tasks)


@njit
def _load(counters, i):
    return atomic_load(counters, i)


@njit(parallel=True)
def _claim_all(n_workers, counters, taken, n_tasks, n_steps):
    for worker in prange(n_workers):
        for s in range(n_steps):
            base = s * (n_workers + 1) * COUNTER_STRIDE
            while True:
                t = claim(counters, base, worker, n_workers, n_tasks)
                if t < 0:
                    break
                taken[s, t, worker] += 1
                atomic_add(counters, base + n_workers * COUNTER_STRIDE, 1)
            wait_until(counters, base + n_workers * COUNTER_STRIDE, n_tasks)


@pytest.mark.parametrize("n_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("n_tasks", [1, 2, 7, 40])
def test_each_task_is_claimed_once_and_a_worker_starts_with_its_home_block(n_workers, n_tasks):
    n_steps = 20
    counters = np.zeros((n_workers + 1) * n_steps * COUNTER_STRIDE, np.int64)
    taken = np.zeros((n_steps, n_tasks, n_workers), np.int64)
    _claim_all(n_workers, counters, taken, n_tasks, n_steps)  # as many workers as threads or more (5 on 2 cores)
    assert np.array_equal(taken.sum(axis=2), np.ones((n_steps, n_tasks), np.int64))
    # one worker alone takes every task: its home block first, in order, then the others' blocks
    counters = np.zeros((n_workers + 1) * COUNTER_STRIDE, np.int64)
    order = [_claim(counters, n_workers - 1, n_workers, n_tasks) for _ in range(n_tasks + 1)]
    per_block = -(-n_tasks // n_workers)
    home = list(range((n_workers - 1) * per_block, min(n_tasks, n_workers * per_block)))
    assert order[:len(home)] == home and sorted(order[:-1]) == list(range(n_tasks)) and order[-1] == -1


@njit
def _claim(counters, worker, n_workers, n_tasks):
    return claim(counters, 0, worker, n_workers, n_tasks)


@pytest.mark.parametrize("int8_layers, int8_head, logits", [(False, False, True), (True, True, True),
                                                            (True, False, False)])
@pytest.mark.parametrize("n_workers", [1, 2, 3])
@pytest.mark.parametrize("pieces", [1, 3])
def test_each_step_looks_ahead_to_the_next_step_that_reads_a_weight(int8_layers, int8_head, logits, n_workers, pieces):
    outputs_of = {_step.QKV: 96, _step.O_PROJ: 64, _step.GATE_UP: 80, _step.DOWN: 64, _step.HEAD: 1000}
    kinds, layers, tasks, rows, ahead = _step._plan(3, outputs_of, 2, int8_layers, int8_head, logits, n_workers,
                                                    pieces)
    # the attention's tasks are its pieces of the two kv heads' slots, combined in a step of their own if more than one
    assert np.all(tasks[kinds == _step.ATTEND] == 2 * pieces)
    assert np.sum(kinds == _step.COMBINE) == (3 if pieces > 1 else 0)
    assert np.all(kinds[np.flatnonzero(kinds == _step.COMBINE) - 1] == _step.ATTEND)
    linear = np.isin(kinds, _step.LINEAR_STEPS)
    for s in range(kinds.size):
        later = np.flatnonzero(linear[s + 1:])
        assert ahead[s] == (s + 1 + later[0] if later.size else -1)


@pytest.mark.parametrize("first_task, last_task, rows_per_task, n_features, row_bytes, pair", [
    (0, 4, 16, 64, 576, False),  # the whole block fits the budget
    (4, 8, 16, 100, 576, False),  # the last block ends at the features' end
    (2, 5, 512, 49152, 576, False),  # the budget ends it
    (0, 3, 64, 1536, 2304, True),  # gate and up rows share the budget
    (3, 3, 16, 64, 576, False),  # an empty home block asks for nothing
    (0, 1, 16, 8, 1 << 20, False),  # a row past the budget: still one
])
def test_the_rows_asked_for_ahead_start_the_home_block_within_the_budget(first_task, last_task, rows_per_task,
                                                                        n_features, row_bytes, pair):
    first, last = _step._ahead_rows(first_task, last_task, rows_per_task, n_features, row_bytes, pair)
    block_end = min(last_task * rows_per_task, n_features)
    assert first == first_task * rows_per_task
    halves = 2 if pair else 1
    if first >= block_end:
        assert last == first
    else:
        assert first < last <= block_end
        asked = (last - first) * row_bytes * halves
        assert asked <= max(_step.AHEAD_BYTES, row_bytes * halves)  # no more rows than the budget holds (one at least)
        assert last == block_end or asked + row_bytes * halves > _step.AHEAD_BYTES  # nor fewer


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
@pytest.mark.parametrize("pair", [False, True])
def test_a_wait_that_streams_ahead_returns_once_the_count_is_reached(dtype, pair):
    w = np.ones((64, 40), dtype=dtype)
    counters = np.zeros(2 * COUNTER_STRIDE, np.int64)
    counters[COUNTER_STRIDE] = 3
    _step._wait_streaming(counters, COUNTER_STRIDE, 3, w, 0, 32 if pair else 64, pair)  # up to the array's end
    _step._wait_streaming(counters, COUNTER_STRIDE, 3, w, 5, 5, pair)  # nothing to ask for
    assert counters[COUNTER_STRIDE] == 3 and np.all(w == 1)


@pytest.mark.parametrize("kind", ["fp32", "int8 rows", "int8 panels"])
def test_the_blocks_weights_lie_in_one_array_in_the_order_a_token_reads_them(rng, monkeypatch, kind):
    int8, in_panels = kind != "fp32", kind == "int8 panels"
    monkeypatch.setattr(panels, "PANELS", in_panels)
    layers, an, fn, final, head = _model(rng, 3, 4, 2, 8, 40, 77, int8, int8, 6.0)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=8, eps=1e-5)

    def as_read(w, j):  # float32 and int8 rows as they are; int8 panels, w_gate_up's gate and up halves apart
        if not in_panels:
            return w.weight.w_i8 if int8 else w
        rows = w.weight.w_i8
        halves = [rows[:40], rows[40:]] if j == 2 else [rows]  # an intermediate size of 40: 2.5 panels a half
        return np.concatenate([panels.pack(h) for h in halves])

    # block 0's four, block 1's, ...
    weights = [as_read(w, j) for block in layers for j, w in enumerate(block)]
    assert np.array_equal(step.block_weights, np.concatenate([w.reshape(-1) for w in weights]))
    for j, name in enumerate(decode.LlamaDecodeStep.NAMES):
        view = step.stacks[name][0] if int8 else step.stacks[name]  # the rows, for the per-layer path
        assert np.shares_memory(view, step.block_weights) != in_panels  # one copy but beside panels
        assert all(np.array_equal(view[i], (layers[i][j].weight.w_i8 if int8 else layers[i][j])) for i in range(3))
    if int8:  # the head as the products read it, its rows in place
        assert np.array_equal(step._head8, panels.pack(head.weight.w_i8) if in_panels else head.weight.w_i8)
        assert np.shares_memory(step.stacks["head"][0], head.weight.w_i8)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 576, 960, 1536, 49152, 49153])
def test_each_task_of_a_linear_step_starts_an_int8_panel(n, threads):
    # the int8 panels' kernel reads whole panels from a task's first output on (kernels.int8.panels)
    outputs = {kind: n for kind in (_step.QKV, _step.O_PROJ, _step.GATE_UP, _step.DOWN, _step.HEAD)}
    kinds, _, tasks, rows, _ = _step._plan(2, outputs, 2, True, True, True, threads, 1)
    for s in np.flatnonzero(np.isin(kinds, _step.LINEAR_STEPS)):
        assert rows[s] % panels.PANEL_ROWS == 0 or tasks[s] == 1
        assert (tasks[s] - 1) * rows[s] < n <= tasks[s] * rows[s]


@pytest.mark.skipif(not HUGE_PAGES, reason=NO_HUGE_PAGES)
def test_the_blocks_weights_lie_on_huge_pages(rng):
    layers, an, fn, final, head = _model(rng, 3, 4, 2, 64, 1024, 77, True, True, 6.0)  # 2.9 MB of int8 weights
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=4, n_kv_heads=2, head_dim=64, eps=1e-5)
    assert step.block_weights.nbytes >= HUGE_PAGE_BYTES
    assert step.block_weights.ctypes.data % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(step.block_weights.ctypes.data)


def _token_by_token(step, first, n_tokens, embedding, cos, sin, keys, values, slots, stop):
    """``LlamaDecodeStep.greedy`` in Python: each token through the step, the next one its logits' argmax."""
    tokens, token = [], first
    for i in range(n_tokens):
        if token == stop:
            break
        tokens.append(token)
        token = int(np.argmax(step(embedding[token].copy(), cos[i], sin[i], keys, values, slots)))
        slots += 1
    return tokens


@pytest.mark.parametrize("mode", ["fp32", "int8", "int8-head"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start", [0, PIECE_SLOTS - 3])  # from an empty cache; across the attention's piece edge
def test_greedy_decoding_in_one_loop_equals_the_step_token_by_token(rng, int8_path, mode, threads, start):
    L, hq, hkv, d, inter, vocab = 2, 4, 2, 8, 40, 37
    int8, int8_head = mode != "fp32", mode == "int8-head"
    layers, an, fn, final, head = _model(rng, L, hq, hkv, d, inter, vocab, int8, int8_head, 1.5)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=hq, n_kv_heads=hkv, head_dim=d, eps=1e-5)
    n_tokens = 9 if start else _step.GREEDY_TOKENS + 6  # past a piece's edge; past the tokens of one call
    capacity = start + n_tokens + 3
    embedding = (3 * rng.standard_normal((vocab, hq * d))).astype(np.float32)
    angles = rng.uniform(0, 2 * np.pi, (n_tokens, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    keys, values = (rng.standard_normal((L, hkv, capacity, d)).astype(np.float32) for _ in range(2))
    slots = np.array([max(0, start - 5), start], dtype=np.int64)  # layers at different lengths, the last longest
    first = int(rng.integers(vocab))
    with numba_threads(threads):
        ref_keys, ref_values, ref_slots = keys.copy(), values.copy(), slots.copy()
        reference = _token_by_token(step, first, n_tokens, embedding, cos, sin, ref_keys, ref_values, ref_slots,
                                    -1)
        # no stop; a stop token met on the way (the tokens before it only); the first token a stop (none)
        for stop in (-1, reference[5], first):
            k, v, s = keys.copy(), values.copy(), slots.copy()
            calls = step._calls
            tokens = step.greedy(np.uint64(first), n_tokens, embedding, cos, sin, k, v, s, stop=stop)
            expected = reference[:reference.index(stop)] if stop in reference else reference
            assert tokens == expected and np.array_equal(s, slots + len(expected))
            assert step._calls == calls + len(expected)  # each token a call of the step, as token by token
            n = len(expected)
            k_ref, v_ref, s_ref = keys.copy(), values.copy(), slots.copy()
            _token_by_token(step, first, n, embedding, cos, sin, k_ref, v_ref, s_ref, -1)
            assert np.array_equal(k, k_ref) and np.array_equal(v, v_ref)  # the same cache, bit for bit
    assert step.greedy(first, 0, embedding, cos[:0], sin[:0], keys, values, slots.copy()) == []


def test_bad_greedy_calls_are_refused(rng):
    layers, an, fn, final, head = _model(rng, 2, 2, 1, 4, 8, 10, False, False, 6.0)
    step = decode.LlamaDecodeStep(layers, an, fn, final, head, n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    keys = rng.standard_normal((2, 1, 6, 4)).astype(np.float32)
    embedding, cs = rng.standard_normal((10, 8)).astype(np.float32), np.ones((3, 2), np.float32)
    slots = np.array([1, 0], dtype=np.int64)

    def call(token=2, n=3, emb=embedding, cos=cs, sl=None, **kwargs):  # cos for sin too
        return step.greedy(token, n, emb, cos, cos, keys.copy(), keys.copy(), slots.copy() if sl is None else sl,
                           **kwargs)

    for token in (10, -1):
        with pytest.raises(ValueError, match="token must be in"):
            call(token)
    for bad in (True, 2.0, None):
        with pytest.raises(TypeError, match="token must be an int"):
            call(bad)
    with pytest.raises(TypeError, match="stop must be an int"):
        call(stop="x")
    with pytest.raises(ValueError, match="n_tokens >= 0"):
        call(n=-1)
    with pytest.raises(ValueError, match="embedding must be"):
        call(emb=embedding[:, :7].copy())
    with pytest.raises(ValueError, match="embedding must be"):
        call(emb=embedding.astype(np.float64))
    with pytest.raises(ValueError, match="cos must be"):
        call(cos=np.ones((2, 2), np.float32))  # a row for each of the n tokens
    with pytest.raises(ValueError, match="cos must be"):
        call(cos=np.ones((3, 4), np.float32)[:, ::2])  # not C-contiguous
    with pytest.raises(ValueError, match="sin must be"):
        step.greedy(2, 3, embedding, cs, cs[:, :1].copy(), keys.copy(), keys.copy(), slots.copy())
    with pytest.raises(TypeError, match="slots must be a writeable int64"):
        call(sl=slots.astype(np.int32))
    read_only = slots.copy()
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="slots must be a writeable int64"):
        call(sl=read_only)
    with pytest.raises(TypeError, match="n_tokens must be an int"):
        call(n=3.0)
    with pytest.raises(TypeError, match="slots must be a writeable int64"):
        call(sl=[1, 0])
    with pytest.raises(ValueError, match="no room for 3 tokens after slot 4"):
        call(sl=np.array([4, 0], dtype=np.int64))
    with pytest.raises(ValueError, match="slots must be"):
        call(sl=np.array([6, 0], dtype=np.int64))


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_decoding_refuses_a_token_whose_logits_are_not_finite(rng, threads):
    layers, an, fn, final, head = _model(rng, 2, 2, 1, 4, 8, 300, True, False, 6.0)
    kwargs = dict(n_heads=2, n_kv_heads=1, head_dim=4, eps=1e-5)
    embedding = rng.standard_normal((300, 8)).astype(np.float32)
    cs = np.ones((4, 2), np.float32)
    keys = rng.standard_normal((2, 1, 8, 4)).astype(np.float32)
    with numba_threads(threads):
        step = decode.LlamaDecodeStep(layers, an, fn, final, head, **kwargs)
        h = step(embedding[5].copy(), cs[0], cs[0], keys.copy(), keys.copy(), [1, 1], logits=False)
        bad_head = head.copy()
        bad_head[211] = 3e38 * np.sign(h)  # the first token's logit 211 is a sum past float32's range
        step = decode.LlamaDecodeStep(layers, an, fn, final, bad_head, **kwargs)
        slots = np.array([1, 1], dtype=np.int64)
        with pytest.raises(ValueError, match="produced 1 values that are not finite"):
            step.greedy(5, 4, embedding, cs, cs, keys.copy(), keys.copy(), slots)
        assert np.array_equal(slots, [1, 1])  # the refused token's slot not taken, as after ``__call__``
