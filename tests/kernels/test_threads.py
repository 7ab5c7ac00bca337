"""kernels._common.threads: small calls run on the calling thread alone (``serial_if_small``), large ones on the
pool; the thread count is restored afterwards, and the results do not depend on it; no call leaves a thread running
after it returns; with the option IOAWARE_SERIAL_WHEN_HELD, calls beside held cores run on the calling thread."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import pytest

import kernels
from kernels import int8
from kernels._common import threads
from kernels._common.prefetch import PREFETCH_ROWS
from kernels.attn import _api as attn_api
from kernels.int8 import _api as int8_api

from tests.helpers import assert_close, numba_threads


@pytest.fixture(autouse=True)
def _no_serial_when_held(monkeypatch):
    """The tests here count threads with the option IOAWARE_SERIAL_WHEN_HELD off (on, as by default, NumPy's pool
    polling after a test's own products would keep calls on the calling thread); the option's own tests set it."""
    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", False)


def _threads_inside(monkeypatch, module, name):
    """Wrap module.name so that each call records Numba's thread count at that moment."""
    seen = []
    original = getattr(module, name)

    def recording(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


@pytest.mark.parametrize("work, small", [(dict(multiply_adds=threads.SERIAL_MULTIPLY_ADDS - 1), True),
                                         (dict(multiply_adds=threads.SERIAL_MULTIPLY_ADDS), False),
                                         (dict(elements=threads.SERIAL_ELEMENTS - 1), True),
                                         (dict(elements=threads.SERIAL_ELEMENTS), False),
                                         (dict(multiply_adds=1, elements=threads.SERIAL_ELEMENTS), False)])
def test_the_context_limits_only_small_work_and_restores_the_count(work, small):
    before = numba.get_num_threads()
    with threads.serial_if_small(**work):
        inside = numba.get_num_threads()
    assert inside == (1 if small else before)
    assert numba.get_num_threads() == before


def test_the_count_is_restored_when_the_call_raises():
    before = numba.get_num_threads()
    with pytest.raises(ZeroDivisionError):
        with threads.serial_if_small(multiply_adds=1):
            1 / 0
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("nq, nk, causal", [(1, 1, True), (5, 3, True), (3, 5, True), (7, 7, True), (4, 9, False),
                                            (1, 4096, True)])
def test_multiply_adds_count_the_pairs_a_query_sees(nq, nk, causal):
    pairs = sum(1 for i in range(nq) for j in range(nk) if not causal or j <= i + nk - nq)
    assert attn_api.multiply_adds((2, 3, nq, 8), (2, 1, nk, 8), causal) == 2 * 2 * 3 * 8 * pairs


@pytest.fixture
def two_threads():
    """Numba's pool at 2 threads for the test, restored after it."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a pool of 2 threads or more")
    with numba_threads(2):
        yield


def test_attention_runs_small_calls_on_one_thread_and_large_ones_on_the_pool(rng, monkeypatch, two_threads):
    seen = _threads_inside(monkeypatch, attn_api._numba_cpu, "flash_forward")
    small = rng.standard_normal((1, 2, 33, 16), dtype=np.float32)  # 2 · 2 · 16 · 561 multiply-adds
    out = kernels.attention(small, small, small, causal=True)
    q = rng.standard_normal((1, 8, 512, 64), dtype=np.float32)  # 2^28 multiply-adds
    kernels.attention(q, q, q)
    assert seen == [1, 2]
    ref = kernels.attn.reference(small.astype(np.float64), small.astype(np.float64), small.astype(np.float64),
                                 causal=True)
    assert_close(out, ref, np.float32)


def test_quantize_vectorwise_runs_small_inputs_on_one_thread(rng, monkeypatch, two_threads):
    seen = _threads_inside(monkeypatch, int8_api._numba_cpu, "quantize_rows")
    x = rng.standard_normal((3, 70), dtype=np.float32)
    x_i8, absmax = int8.quantize_vectorwise(x)
    int8.quantize_vectorwise(rng.standard_normal((2048, 1024), dtype=np.float32))  # 2^21 elements
    assert seen == [1, 2]
    ref_i8, ref_absmax = int8.quantize_reference(x, axis=1)
    assert np.array_equal(x_i8, ref_i8) and np.array_equal(absmax, ref_absmax)


@pytest.mark.parametrize("ahead", [0, PREFETCH_ROWS])  # the rows' prefetch off (AMD) and on (other vendors)
def test_an_int8_gemv_runs_small_products_on_one_thread(rng, monkeypatch, two_threads, ahead):
    module = int8_api._vnni if int8_api.USE_VNNI else int8_api._numba_cpu
    monkeypatch.setattr(int8_api.rows, "ROW_PREFETCH", ahead)
    seen = _threads_inside(monkeypatch, int8_api.rows, "gemv")  # one vector on the calling thread: the row kernel
    # where its prefetch is on, else the blocked kernel on that thread
    seen_pool = _threads_inside(monkeypatch, module, "split_gemv")  # on the pool: the blocked kernel
    small = int8.Int8Linear.from_float(rng.standard_normal((300, 130), dtype=np.float32))  # 39 000 multiply-adds
    x = rng.standard_normal((1, 130), dtype=np.float32)
    x[0, 7] = 20.0  # an outlier feature
    y = small(x)
    int8.Int8Linear.from_float(rng.standard_normal((4096, 4096), dtype=np.float32))(
        rng.standard_normal((1, 4096), dtype=np.float32))  # 2^24 multiply-adds
    assert (seen, seen_pool) == (([1], [2]) if ahead else ([], [1, 2]))
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 0)  # the same call on the pool: the same bits
    assert np.array_equal(small(x), y) and seen_pool[-1] == 2


def test_a_dense_gemv_runs_small_products_on_one_thread(rng, monkeypatch, two_threads):
    from kernels import dense

    seen = _threads_inside(monkeypatch, dense, "_gemv_nt")
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    x = rng.standard_normal((1, 576), dtype=np.float32)
    y = dense.matmul_nt(x, w)  # 884 736 multiply-adds
    dense.matmul_nt(rng.standard_normal((1, 4096), dtype=np.float32),
                    rng.standard_normal((4096, 4096), dtype=np.float32))  # 2^24
    assert seen == [1, 2]
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert_close(y, ref, np.float32, scale=np.abs(ref).max())  # a matmul: the tolerance of its largest sum


def _blas_calls(monkeypatch):
    """Record (Numba's threads, tasks) at each call of ``blas``'s product kernels (their task range: last - first)."""
    from kernels._common import blas

    seen = []
    for name in ("_batched_nt", "_batched_nn"):
        def recording(*args, kernel=getattr(blas, name)):
            first, last = args[-3:-1]
            seen.append((numba.get_num_threads(), int(last - first)))
            return kernel(*args)
        monkeypatch.setattr(blas, name, recording)
    return seen


def test_a_dense_prefill_runs_small_products_on_one_thread(rng, monkeypatch, two_threads):
    from kernels import dense

    seen = _blas_calls(monkeypatch)
    x, w = rng.standard_normal((17, 96), dtype=np.float32), rng.standard_normal((80, 96), dtype=np.float32)
    y = dense.matmul_nt(x, w)  # 17 rows (past the GEMV's 16): 130 560 multiply-adds
    dense.matmul_nt(rng.standard_normal((256, 576), dtype=np.float32),
                    rng.standard_normal((1536, 576), dtype=np.float32))  # 2^27.75
    # planned for one thread: 4 tasks (blocks of 32 columns); for the pool's two: 8 (blocks of 192 columns)
    assert seen == [(1, 4), (2, 8)]
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert_close(y, ref, np.float32, scale=np.abs(ref).max())
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 0)  # the same product on the pool: the same bits
    assert np.array_equal(dense.matmul_nt(x, w), y) and seen[-1] == (2, 8)  # (17 rows in 8 row blocks)


def test_kv_pruning_runs_small_scorings_on_one_thread(rng, monkeypatch, two_threads):
    from kernels import kvprune
    from kernels.kvprune import _numba_cpu as prune_cpu

    seen = {name: _threads_inside(monkeypatch, prune_cpu, name)
            for name in ("window_scores", "pool", "accumulated_attention")}
    q = rng.standard_normal((1, 4, 200, 32), dtype=np.float32)
    k = rng.standard_normal((1, 2, 200, 32), dtype=np.float32)
    small = kvprune.snapkv_scores(q[:, :, -16:], k), kvprune.h2o_scores(q, k)  # 0.41 M and 3.9 M multiply-adds
    q_big = rng.standard_normal((1, 8, 2048, 64), dtype=np.float32)
    k_big = rng.standard_normal((1, 2, 2048, 64), dtype=np.float32)
    kvprune.snapkv_scores(q_big[:, :, -1024:], k_big)  # 2^30 multiply-adds; its pooling 57 344 reads, still small
    kvprune.h2o_scores(q_big, k_big)  # 2^30
    assert seen == {"window_scores": [1, 2], "pool": [1, 1], "accumulated_attention": [1, 2]}
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 0)  # the same scorings on the pool: the same bits
    monkeypatch.setattr(threads, "SERIAL_ELEMENTS", 0)
    again = kvprune.snapkv_scores(q[:, :, -16:], k), kvprune.h2o_scores(q, k)
    assert all(np.array_equal(a, b) for a, b in zip(again, small))
    assert [seen[name][-1] for name in seen] == [2, 2, 2]


def _gemm_module():
    """The module whose ``gemm_i8`` computes an int8 product of activations within ±127 on this target."""
    if int8_api.USE_VNNI:
        return int8_api._vnni
    return int8_api._avx2 if int8_api._avx2.AVAILABLE else int8_api._numba_cpu


def test_int8_matmul_runs_its_small_passes_on_one_thread_and_its_gemm_on_the_pool(rng, monkeypatch, two_threads):
    product = int8_api._vnni if int8_api.USE_VNNI else int8_api._numba_cpu
    x = rng.standard_normal((128, 1024), dtype=np.float32)  # 131 072 elements
    x[:, [5, 600]] *= 30  # two outlier features
    w = int8.Int8Linear.from_float(rng.standard_normal((1024, 1024), dtype=np.float32)).weight  # 2^27 multiply-adds
    seen = {name: _threads_inside(monkeypatch, module, name) for module, name in
            ((int8_api._numba_cpu, "outlier_flags"), (product, "quantize_rows"), (_gemm_module(), "gemm_i8"),
             (int8_api._numba_cpu, "add_outlier_product"))}
    y = int8.int8_matmul(x, w)
    assert seen == {"outlier_flags": [1], "quantize_rows": [1], "gemm_i8": [2], "add_outlier_product": [1]}
    monkeypatch.setattr(threads, "SERIAL_ELEMENTS", 0)  # every pass on the pool: the same bits
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 0)
    assert np.array_equal(int8.int8_matmul(x, w), y)


def test_quantizing_a_weight_runs_small_weights_on_one_thread(rng, monkeypatch, two_threads):
    seen = _threads_inside(monkeypatch, int8_api._numba_cpu, "quantize_rows")
    seen_sums = _threads_inside(monkeypatch, int8_api._vnni, "row_sums")
    w = rng.standard_normal((300, 130), dtype=np.float32)  # 39 000 elements
    small = int8.Int8Weight.from_float(w)
    int8.Int8Weight.from_float(rng.standard_normal((2048, 1024), dtype=np.float32))  # 2^21: a float32 pass
    int8.Int8Weight.from_float(rng.standard_normal((4096, 4096), dtype=np.float32))  # 2^24 int8 row sums
    assert seen == [1, 2, 2] and seen_sums == [1, 1, 2]  # the row sums of 2^21 int8 bytes: as a small GEMV
    ref_i8, ref_absmax = int8.quantize_reference(w, axis=1)
    assert np.array_equal(small.w_i8, ref_i8) and np.array_equal(small.absmax, ref_absmax)
    assert np.array_equal(small.w_row_sums, ref_i8.sum(axis=1, dtype=np.int64))


def test_int8_gemm_runs_small_products_on_one_thread(rng, monkeypatch, two_threads):
    seen = _threads_inside(monkeypatch, _gemm_module(), "gemm_i8")
    seen_sums = _threads_inside(monkeypatch, int8_api._vnni, "row_sums")
    x_i8 = rng.integers(-127, 128, size=(5, 70), dtype=np.int8)
    w_i8 = rng.integers(-127, 128, size=(30, 70), dtype=np.int8)  # 10 500 multiply-adds
    c = int8.int8_gemm(x_i8, w_i8)
    int8.int8_gemm(rng.integers(-127, 128, size=(1, 4096), dtype=np.int8),
                   rng.integers(-127, 128, size=(1024, 4096), dtype=np.int8))  # 2^22, its row sums too
    int8.int8_gemm(rng.integers(-127, 128, size=(64, 512), dtype=np.int8),
                   rng.integers(-127, 128, size=(512, 512), dtype=np.int8))  # 2^24
    assert seen == [1, 1, 2]
    assert seen_sums == ([1, 1, 2] if int8_api.USE_VNNI else [])  # only the vpdpbusd product needs them
    assert np.array_equal(c, x_i8.astype(np.int64) @ w_i8.astype(np.int64).T)


# -- the design's promise: a call leaves no thread running ----------------------------------------------------------
AFTER_S = 0.05  # the pause after a call over which the process's other threads must stay idle
IDLE_SHARE = 0.1  # of one core, over AFTER_S: a spinning thread uses all of it; the process clock's ticks (a few
# milliseconds per thread, ``simulator.measure``) stay below


def _others_cpu_s(pause_s):
    """The CPU seconds that threads other than this one used while this one slept ``pause_s``."""
    process, own = time.process_time(), time.thread_time()
    time.sleep(pause_s)
    return (time.process_time() - process) - (time.thread_time() - own)


def _pool_call(rng, name):
    """A public call with work at least twice ``serial_if_small``'s thresholds: on the pool."""
    from kernels import dense, kvprune

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    if name == "flash" or name == "standard":
        q = rand(1, 8, 512, 64)  # 2^28 multiply-adds (flash: causal, about half)
        return lambda: kernels.attention(q, q, q, causal=name == "flash", algorithm=name)
    if name == "flash decode":
        q, kv = rand(1, 32, 1, 64), rand(1, 8, 16384, 64)  # 2^26
        return lambda: kernels.attention(q, kv, kv, causal=True)
    if name == "Int8Linear GEMV":
        layer, x = int8.Int8Linear.from_float(rand(4096, 8192)), rand(1, 8192)  # 2^25
        return lambda: layer(x)
    if name == "int8_matmul":
        x, w = rand(128, 1024), rand(1024, 1024)  # 2^27
        return lambda: int8.int8_matmul(x, w)
    if name == "quantize_vectorwise":
        x = rand(4096, 1024)  # 2^22 elements
        return lambda: int8.quantize_vectorwise(x)
    if name == "dense prefill":
        x, w = rand(256, 576), rand(1536, 576)  # 2^27.75
        return lambda: dense.matmul_nt(x, w)
    q, k = rand(1, 9, 2048, 64), rand(1, 3, 2048, 64)  # SnapKV's window 2^25.2, H2O's scores 2^30
    if name == "snapkv_compress":
        return lambda: kvprune.snapkv_compress(q, k, k, capacity=512)
    return lambda: kvprune.h2o(q, k, k, capacity=512)


@pytest.mark.parametrize("name", ["flash", "standard", "flash decode", "Int8Linear GEMV", "int8_matmul",
                                  "quantize_vectorwise", "dense prefill", "snapkv_compress", "h2o"])
def test_no_call_leaves_a_thread_running(rng, monkeypatch, two_threads, name):
    """Numba's workers sleep as a call returns (passive waits), and no call wakes a pool of another library (NumPy's
    BLAS spins ~0.1 s after each of its calls): the process's other threads idle in the pause after it."""
    from kernels._common import affinity
    from simulator.measure import settle

    if kernels.pool_info()["wait_policy"] != "PASSIVE":
        pytest.skip(f"the pool waits as the user set it ({kernels.pool_info()['wait_policy']}), not passively")

    call = _pool_call(rng, name)
    call()  # compiled and warm
    on_the_pool = []  # serial_if_small steers the workers where it leaves a pass to the pool
    steer = affinity.steer_workers
    monkeypatch.setattr(affinity, "steer_workers", lambda: on_the_pool.append(1) or steer())
    settle(1.0)  # other pools' threads (of tests before this one) at rest
    before = _others_cpu_s(AFTER_S)
    call()
    after = _others_cpu_s(AFTER_S)
    assert on_the_pool, f"{name} ran on the calling thread alone: no worker to leave running"
    assert before < IDLE_SHARE * AFTER_S, f"the process was not idle before the call: {before * 1e3:.1f} ms of CPU"
    assert after < IDLE_SHARE * AFTER_S, (f"other threads used {after * 1e3:.1f} ms of CPU in the {AFTER_S * 1e3:.0f} "
                                          f"ms after {name}")


SPINNING_POOL = """
import time, numpy as np, kernels
from tests.kernels.test_threads import AFTER_S, _others_cpu_s
q = np.random.default_rng(0).standard_normal((1, 8, 512, 64), dtype=np.float32)
kernels.attention(q, q, q)
time.sleep(0.2)
kernels.attention(q, q, q)
print(kernels.pool_info()["wait_policy"], _others_cpu_s(AFTER_S) / AFTER_S)
"""


def test_the_pause_finds_a_spinning_pool():
    """The check above fails where the pool spins: the same measure after a call in a process whose user asked
    OpenMP to spin (``OMP_WAIT_POLICY=ACTIVE``, which the design leaves to the user: ``threads.configure_pool``)."""
    from kernels._common.affinity import pool_cpu_count

    if numba.config.NUMBA_NUM_THREADS < 2 or pool_cpu_count() < 2:
        pytest.skip("needs a pool of 2 threads on 2 CPUs or more: a pool of one has no worker to spin")
    if kernels.pool_info()["threading_layer"] != "omp":
        pytest.skip("OMP_WAIT_POLICY is the OpenMP layer's; this process's pool runs another layer")
    root = Path(__file__).resolve().parents[2]
    # two threads: with more threads than CPUs, GNU OpenMP spins only briefly even when asked to spin
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE", "NUMBA_NUM_THREADS": "2", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", SPINNING_POOL], env=env, cwd=root, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out[0].startswith("OMP_WAIT_POLICY=ACTIVE")
    assert float(out[-1]) > IDLE_SHARE  # a worker spinning through the pause (a core's whole share where it had one)


@pytest.mark.parametrize("held, switch, threads_inside", [
    ("all", True, 1),  # every CPU of the pool but the caller's held: on the calling thread
    ("all", False, 2),  # the option off (IOAWARE_SERIAL_WHEN_HELD=0): the workers share them
    ("some", True, 2),  # a CPU free (or none held where the pool has one CPU)
    ("unknown", True, 2),  # cannot tell (not Linux, the workers unknown)
])
def test_a_call_beside_held_cores_runs_on_the_calling_thread(monkeypatch, two_threads, held, switch, threads_inside):
    from kernels._common import affinity

    cpus = affinity.pool_cpu_count()
    answer = {"all": max(1, cpus - 1), "some": max(0, cpus - 2), "unknown": None}[held]
    monkeypatch.setattr(affinity, "cores_held", lambda: answer)
    monkeypatch.setattr(affinity, "runnable_threads", lambda: None)  # the look at each thread decides
    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", switch)
    with threads.serial_if_small(multiply_adds=2**40):  # however large
        assert numba.get_num_threads() == threads_inside
    assert numba.get_num_threads() == 2


@pytest.mark.parametrize("runnable, looks", [(1, False), (2, True), (None, True), (0, True)])  # 0: not a count
def test_each_thread_is_looked_at_only_where_the_machine_runs_enough(monkeypatch, two_threads, runnable, looks):
    """The machine's count of runnable threads (this one among them) first: one where the pool has two CPUs leaves
    none to hold the other, and the look at each thread is saved; none at all is no count of this kernel's."""
    from kernels._common import affinity

    monkeypatch.setattr(affinity, "pool_cpu_count", lambda: 2)
    monkeypatch.setattr(affinity, "runnable_threads", lambda: runnable)
    looked = []
    monkeypatch.setattr(affinity, "cores_held", lambda: looked.append(1) or 1)
    assert threads._cores_held() == looks and len(looked) == looks


def test_a_call_beside_held_cores_gives_the_same_bits(rng, monkeypatch, two_threads):
    from kernels import dense
    from kernels._common import affinity

    # a decode step's GEMV of 16 rows (dense.GEMV_ROWS) and 2^24.6 multiply-adds: not small
    x, w = rng.standard_normal((16, 1024), dtype=np.float32), rng.standard_normal((1536, 1024), dtype=np.float32)
    seen = _threads_inside(monkeypatch, dense, "_gemv_nt")
    on_the_pool = dense.matmul_nt(x, w)
    monkeypatch.setattr(affinity, "cores_held", lambda: max(1, affinity.pool_cpu_count() - 1))
    monkeypatch.setattr(affinity, "runnable_threads", lambda: None)
    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", True)
    assert np.array_equal(dense.matmul_nt(x, w), on_the_pool) and seen == [2, 1]


def _held_for(monkeypatch, looks):
    """The option on and the other cores held for the first ``looks`` looks, free after; the looks made."""
    made = []

    def held():
        made.append(len(made) < looks)
        return made[-1]

    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", True)
    monkeypatch.setattr(threads, "_cores_held", held)
    return made


UNIT = threads.SERIAL_MULTIPLY_ADDS  # a unit's work in the part tests below: one unit alone is not small


@pytest.mark.parametrize("switch, looks, unit, part, expected, made", [
    (False, 99, UNIT, 3 * UNIT, [(0, 10, 2)], 0),  # the option off: one call on the pool, no look
    (True, 0, UNIT, 3 * UNIT, [(0, 10, 2)], 1),  # nothing held: the same, after one look
    (True, 1, UNIT, 3 * UNIT, [(0, 3, 1), (3, 10, 2)], 2),  # held at first: a part alone, then the rest on the pool
    (True, 2, UNIT, 3 * UNIT, [(0, 3, 1), (3, 6, 1), (6, 10, 2)], 3),
    (True, 99, UNIT, 3 * UNIT, [(0, 3, 1), (3, 6, 1), (6, 9, 1), (9, 10, 1)], 4),  # held throughout
    (True, 99, UNIT // 2, 9 * UNIT // 2, [(0, 9, 1), (9, 10, 1)], 1),  # a small rest: alone, without a look
    (True, 99, 1, 3 * UNIT, [(0, 10, 1)], 0),  # a small call: alone, without a look
    (True, 99, UNIT // 11, 10 * UNIT, [(0, 10, 1)], 0),
])
def test_a_long_call_beside_held_cores_runs_in_parts_until_they_are_free(monkeypatch, two_threads, switch, looks,
                                                                         unit, part, expected, made):
    looked = _held_for(monkeypatch, looks)
    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", switch)
    monkeypatch.setattr(threads, "PART_MULTIPLY_ADDS", part)
    runs = []
    threads.in_parts(10, unit, lambda start, stop: runs.append((start, stop, numba.get_num_threads())))
    assert runs == expected and len(looked) == made
    assert numba.get_num_threads() == 2


@pytest.mark.parametrize("units", [49, 98, 196])
def test_work_of_the_threshold_in_units_is_not_small(monkeypatch, two_threads, units):
    # SERIAL_MULTIPLY_ADDS / units * units is a hair below the threshold in floating point for these counts
    assert (threads.SERIAL_MULTIPLY_ADDS / units) * units < threads.SERIAL_MULTIPLY_ADDS
    _held_for(monkeypatch, 0)
    runs = []
    threads.in_parts(units, threads.SERIAL_MULTIPLY_ADDS / units,
                     lambda start, stop: runs.append((start, stop, numba.get_num_threads())))
    assert runs == [(0, units, 2)]


def test_no_units_run_once():
    runs = []
    threads.in_parts(0, UNIT, lambda start, stop: runs.append((start, stop)))
    assert runs == [(0, 0)]


@pytest.mark.parametrize("start, stop, kv_heads, expected", [
    (0, 4, 4, [(0, 0, 4)]),
    (3, 9, 4, [(0, 3, 4), (1, 0, 4), (2, 0, 1)]),
    (5, 6, 4, [(1, 1, 2)]),
    (2, 2, 4, []),
])
def test_head_groups_cut_units_at_each_batch(start, stop, kv_heads, expected):
    assert list(threads.head_groups(start, stop, kv_heads)) == expected


def _every_unit_a_part(monkeypatch, looks):
    """Any work not small and a part of one unit, the cores held for ``looks`` looks: the looks made."""
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 1)
    monkeypatch.setattr(threads, "PART_MULTIPLY_ADDS", 1)
    return _held_for(monkeypatch, looks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(1, 300), (37, 41)])  # a decode with its keys split, a prefill
def test_flash_in_parts_gives_the_bits_of_the_call_on_the_pool(rng, monkeypatch, two_threads, causal, nq, nk):
    from kernels.attn import reference

    q = rng.standard_normal((2, 6, nq, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 3, nk, 16), dtype=np.float32) for _ in range(2))
    monkeypatch.setattr(attn_api, "SERIAL_MULTIPLY_ADDS", 1)  # planned for the pool (call_threads)
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 1)
    on_the_pool = kernels.attention(q, k, v, causal=causal, block_k=32, return_lse=True)
    looked = _every_unit_a_part(monkeypatch, 4)  # 4 of the 6 (batch, kv head) units alone, across the batches
    o, lse = kernels.attention(q, k, v, causal=causal, block_k=32, return_lse=True)
    assert len(looked) == 5
    assert np.array_equal(o, on_the_pool[0]) and np.array_equal(lse, on_the_pool[1])
    ref_o, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    assert_close(o, ref_o, "float32")
    assert_close(lse, ref_lse, "float32")


def test_a_call_alone_is_planned_for_the_pool(monkeypatch, two_threads):
    """Beside held cores a call runs alone but plans its work for the pool (the same bits either way); a small call
    plans for one thread."""
    monkeypatch.setattr(threads, "SERIAL_WHEN_HELD", True)
    monkeypatch.setattr(threads, "_cores_held", lambda: True)
    with threads.serial_if_small(multiply_adds=2**40):
        assert numba.get_num_threads() == 1 and threads.pool_threads() == 2
        with threads.serial_if_small(multiply_adds=1):  # nested: still the pool's count outside
            assert threads.pool_threads() == 2
        assert threads.pool_threads() == 2
    assert threads.pool_threads() == 2 and numba.get_num_threads() == 2
    assert attn_api.call_threads((1, 8, 512, 64), (1, 8, 512, 64), False) == 2
    assert attn_api.call_threads((1, 2, 33, 16), (1, 2, 33, 16), True) == 1


def test_the_standard_algorithm_beside_held_cores_runs_whole_on_the_calling_thread(rng, monkeypatch, two_threads):
    """Its N x N scores at once, as the algorithm it shows (the report traces their memory)."""
    seen = _threads_inside(monkeypatch, attn_api, "standard_forward")
    q = rng.standard_normal((2, 6, 37, 16), dtype=np.float32)
    looked = _every_unit_a_part(monkeypatch, 99)
    kernels.attention(q, q, q, algorithm="standard")
    assert seen == [1] and len(looked) == 1


@pytest.mark.parametrize("looks", [1, 3, 99])
def test_kv_pruning_scores_in_parts_give_the_same_bits(rng, monkeypatch, two_threads, looks):
    from kernels import kvprune

    q = rng.standard_normal((2, 6, 45, 16), dtype=np.float32)
    k = rng.standard_normal((2, 3, 45, 16), dtype=np.float32)
    calls = (lambda: kvprune.h2o_scores(q, k, block=16), lambda: kvprune.snapkv_scores(q[:, :, -8:], k))
    whole = [call() for call in calls]
    for call, expected in zip(calls, whole):
        looked = _every_unit_a_part(monkeypatch, looks)  # the first ``looks`` of the 6 units alone
        assert np.array_equal(call(), expected)
        assert len(looked) == min(looks + 1, 6)


@pytest.mark.parametrize("causal", [False, True])
def test_the_standard_algorithm_alone_gives_the_bits_of_the_call_on_the_pool(rng, monkeypatch, two_threads, causal):
    """Its products (``blas.batched_matmul``) split for the pool's threads either way (``pool_threads``)."""
    from kernels._common import blas

    q = rng.standard_normal((1, 8, 300, 64), dtype=np.float32)  # 2 · 8 · 64 · 300² = 2^25.4 multiply-adds
    k, v = (rng.standard_normal((1, 8, 300, 64), dtype=np.float32) for _ in range(2))
    seen = _threads_inside(monkeypatch, blas, "pool_threads")
    on_the_pool = kernels.attention(q, k, v, causal=causal, algorithm="standard")
    looked = _held_for(monkeypatch, 99)
    alone = kernels.attention(q, k, v, causal=causal, algorithm="standard")
    assert len(looked) == 1 and seen[-1] == 1  # it ran alone
    assert np.array_equal(alone, on_the_pool)


@pytest.mark.parametrize("looks", [0, 1, 3, 99])
@pytest.mark.parametrize("transpose_b", [True, False])
@pytest.mark.parametrize("G, M, K, N, tasks", [
    (1, 37, 45, 300, 8),  # 2 threads · TASKS_PER_THREAD blocks (of columns, where b is transposed)
    (3, 70, 19, 33, 9),  # the 8 tasks shared by 3 matrices: 3 blocks of rows each
])
def test_products_in_parts_give_the_bits_of_the_call_on_the_pool(rng, monkeypatch, two_threads, looks, transpose_b,
                                                                 G, M, K, N, tasks):
    """``blas.batched_matmul(parts=True)`` (a prefill's linear layers): beside held cores one block at a time alone,
    looking again before each, the rest on the pool once they are free; its blocks those of the call on the pool."""
    from kernels._common import blas

    a = rng.standard_normal((G, M, K), dtype=np.float32)
    b = rng.standard_normal((G, N, K) if transpose_b else (G, K, N), dtype=np.float32)
    monkeypatch.setattr(threads, "SERIAL_MULTIPLY_ADDS", 1)  # none of these is small
    on_the_pool = blas.batched_matmul(a, b, transpose_b=transpose_b)
    seen = _blas_calls(monkeypatch)
    looked = _every_unit_a_part(monkeypatch, looks)
    alone = blas.batched_matmul(a, b, transpose_b=transpose_b, parts=True)
    assert np.array_equal(alone, on_the_pool)
    assert blas.TASKS_PER_THREAD == 4 and sum(count for _, count in seen) == tasks
    alone_parts = min(looks, tasks)
    assert seen == [(1, 1)] * alone_parts + ([(2, tasks - alone_parts)] if alone_parts < tasks else [])
    assert len(looked) == min(looks + 1, tasks)
    reference = np.einsum("gmk,gnk->gmn" if transpose_b else "gmk,gkn->gmn", a.astype(np.float64),
                          b.astype(np.float64))
    assert_close(alone, reference, "float32", scale=np.abs(reference).max())  # a matmul: its largest sum's tolerance


def test_a_prefill_linear_beside_held_cores_runs_in_parts(rng, monkeypatch, two_threads):
    from kernels import dense

    x, w = rng.standard_normal((256, 576), dtype=np.float32), rng.standard_normal((1536, 576), dtype=np.float32)
    on_the_pool = dense.matmul_nt(x, w)
    looked = _held_for(monkeypatch, 2)  # 2^27.75 multiply-adds in 8 blocks: a block a part, two alone
    assert np.array_equal(dense.matmul_nt(x, w), on_the_pool) and len(looked) == 3


def test_flash_in_parts_refuses_what_the_whole_call_would_not_fit(rng, monkeypatch, two_threads):
    from kernels._common import memory

    q = rng.standard_normal((2, 6, 37, 16), dtype=np.float32)
    k = rng.standard_normal((2, 3, 41, 16), dtype=np.float32)
    _every_unit_a_part(monkeypatch, 99)
    predicted = kernels.attn.flash_memory_bytes(q.shape, k.shape, 4)
    monkeypatch.setattr(memory, "MIN_CHECKED_BYTES", 0)  # check even this small allocation
    monkeypatch.setattr(memory, "available_bytes", lambda: predicted - 1)
    with pytest.raises(kernels.InsufficientMemoryError, match=f"{predicted} bytes"):
        kernels.attention(q, k, k)
