"""One process of the stall benchmark (run by ``test_bench_stalls.py``, one fresh process per threading option).

Every public kernel at a small and a large size, called ``--rounds`` times interleaved with NumPy BLAS calls and,
where torch is importable, torch calls, as user code mixes them, and five controls of the machine's own spread
(``_controls``); each call's wall time is recorded, and the CPU time that NumPy's BLAS workers used meanwhile
(``NUMPY_POOL``). With ``--decode``, SmolLM2 is loaded (and its decode step compiled) first, and after the
interleaved rounds the process serves decode rounds (``_serve``); with ``--decode-only`` it loads the model and
serves them at once: the fresh process whose rate the other's is held to.
The benchmark asks the two for a round in turn (``test_bench_stalls.run_probe``), so that both see the host's memory
of the same moment.
Writes JSON: {"samples_s": {call: [seconds, ...]}, "numpy_pool": {"threads": how many NumPy's BLAS started (Linux),
"cpu_s": {call: [the CPU seconds they used during each sample]}}, "decode_rounds": [rates, best single reads,
sustained reads], "weight_bytes_per_token": ..., "tasks_per_thread": the count the decode step's tuning kept,
"pool": ...}.

    python benchmarks/stall_probe.py --rounds 30 --out stalls.json [--decode | --decode-only] [--no-torch]
        [--pause-ms 50]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
from numba import njit, prange


def _other_threads():
    """The ids of this process's threads other than the calling one (Linux: /proc/self/task; elsewhere none)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")} - {threading.get_native_id()}
    except OSError:
        return set()


NUMPY_POOL = _other_threads()  # the threads that importing NumPy started: its BLAS's workers (OpenBLAS starts them
# as it loads; Numba's pool and torch's start later, at their first parallel calls). Read as this module is imported,
# which in the probe's own process is before anything else has started threads; in a process that imports it later
# (``prefill_trace.py``), it holds other threads too and is not used there


def _cpu_s(tids):
    """The CPU seconds the threads ``tids`` have used (each one's own clock, ``affinity.threads_cpu_s``; imported
    here, not above: importing kernels starts Numba's pool, whose threads NUMPY_POOL must not hold)."""
    from kernels._common.affinity import threads_cpu_s

    return threads_cpu_s(tids)


def _calls(rng, use_torch):
    """name -> zero-argument callable, in the order one round calls them."""
    import kernels
    from kernels import dense, int8, kvprune

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    calls = {}
    # NumPy's own BLAS, as the user's code calls it between ours
    a_mm = rand(1024, 1024)
    x_gemv, w_gemv = rand(1, 2048), rand(2048, 2048)
    calls["numpy sgemm 1024³"] = lambda: a_mm @ a_mm
    calls["numpy GEMV 2048²"] = lambda: x_gemv @ w_gemv
    if use_torch:
        import torch

        t_x, t_w = torch.from_numpy(rand(64, 2048)), torch.from_numpy(w_gemv)
        t_q = torch.from_numpy(rand(1, 8, 1024, 64))
        calls["torch linear 64×2048²"] = lambda: torch.nn.functional.linear(t_x, t_w)
        calls["torch SDPA N=1024"] = lambda: torch.nn.functional.scaled_dot_product_attention(t_q, t_q, t_q)
    # attention: small and large, flash and standard, and a decode step against a cache (split-KV)
    for n in (128, 2048):
        q = rand(1, 8, n, 64)
        calls[f"flash N={n} causal"] = lambda q=q: kernels.attention(q, q, q, causal=True)
    q_std = rand(1, 8, 512, 64)
    calls["standard N=512"] = lambda: kernels.attention(q_std, q_std, q_std, algorithm="standard")
    q_dec, kv_dec = rand(1, 9, 1, 64), rand(1, 3, 4096, 64)
    calls["flash decode Nk=4096"] = lambda: kernels.attention(q_dec, kv_dec, kv_dec, causal=True)
    # LLM.int8(): the decode GEMV of a layer, small and large, and a prefill-sized split matmul
    for n in (1024, 2048, 4096):
        layer, x = int8.Int8Linear.from_float(rand(n, n)), rand(1, n)  # square: the weight layout does not matter
        calls[f"Int8Linear GEMV {n}²"] = lambda layer=layer, x=x: layer(x)
    x_mm, w_mm = rand(128, 1024), rand(1024, 1024)
    calls["int8_matmul 128×1024²"] = lambda: int8.int8_matmul(x_mm, w_mm)
    calls["quantize_vectorwise 128×1024"] = lambda: int8.quantize_vectorwise(x_mm)
    # float32 linears of a model
    w_dense = rand(1536, 576)
    x_dec, x_pre = rand(1, 576), rand(256, 576)
    calls["dense GEMV 576→1536"] = lambda: dense.matmul_nt(x_dec, w_dense)
    calls["dense prefill 256×576→1536"] = lambda: dense.matmul_nt(x_pre, w_dense)
    # KV-cache pruning: SnapKV and H2O over a prompt
    for n in (512, 4096):
        q, k = rand(1, 9, n, 64), rand(1, 3, n, 64)
        calls[f"snapkv_compress N={n}"] = lambda q=q, k=k: kvprune.snapkv_compress(q, k, k, capacity=n // 4)
    q_h, k_h = rand(1, 9, 1024, 64), rand(1, 3, 1024, 64)
    calls["h2o N=1024"] = lambda: kvprune.h2o(q_h, k_h, k_h, capacity=256)
    return calls


# -- controls: what the machine adds -----------------------------------------------------------------------------
# Beside the dense prefill (~3 ms on two threads, whose spread was the widest of ours), the first four as long as it:
# - multiply-adds in registers (eight independent chains, as many as keep a core's floating-point pipes busy; no
#   memory, no cache, no BLAS), on the calling thread and on Numba's pool as ioaware's parallel calls run (a region
#   of one iteration per thread, its workers steered off the caller's CPU first): the cores' own spread (the
#   host's phases, the scheduler, the pool's wake-ups);
# - the prefill's blocks, each thread multiplying arrays of its own on the pool (no shared output, no claims): what
#   two threads of BLAS at once add;
# - the prefill itself on the calling thread alone (the same code, no pool): what its caches and memory add on one
#   core;
# - a read of as many bytes as the 4096² int8 weight (16 MiB), a buffer of its own touched once a round as that
#   weight is, on the pool: what the memory adds to a call that only streams bytes (with a last-level cache of
#   105-480 MiB, as on the Intel Xeon VMs, such a buffer may be found there in some rounds and not in others).
@njit(cache=True)
def _chain(n, a):
    x0, x1, x2, x3, x4, x5, x6, x7 = a, a + 1, a + 2, a + 3, a + 4, a + 5, a + 6, a + 7
    for _ in range(n):  # each chain waits for its last step; the eight together fill the pipes
        x0, x1, x2, x3 = x0 * a + 0.5, x1 * a + 0.5, x2 * a + 0.5, x3 * a + 0.5
        x4, x5, x6, x7 = x4 * a + 0.5, x5 * a + 0.5, x6 * a + 0.5, x7 * a + 0.5
    return x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7


@njit(parallel=True, cache=True)
def _chains(n, a, out):
    for t in prange(out.size):
        out[t] = _chain(n, a)


@njit(parallel=True, cache=True)
def _private_products(a, b, c, repeats):
    for t in prange(a.shape[0]):  # thread t: c[t] = a[t] · b[t]ᵀ, ``repeats`` times
        for _ in range(repeats):
            np.dot(a[t], b[t].T, c[t])


def _controls(prefill, threads):
    """name -> callable: the controls above, the first four each about as long as the median of five calls of
    ``prefill`` (the dense prefill of ``_calls``: (256, 576) · (576, 1536)), the read as long as its bytes take."""
    from kernels._common.affinity import steer_workers
    from kernels._common.blas import COLUMN_ALIGN, TASKS_PER_THREAD, _block, single_threaded_blas
    from kernels._common.threads import serial_if_small
    from simulator.calibrate import read_once

    rng = np.random.default_rng(1)
    a = 0.5  # a value the compiler cannot see: the chains are not folded away (x -> x/2 + 1/2 tends to 1)
    out = np.empty(threads)
    _chain(1000, a), _chains(1000, a, out)  # compile
    n = 1 << 20
    while _timed(lambda: _chain(n, a)) < 1e-3:  # steps per call: enough for a millisecond
        n *= 2
    took = np.median([_timed(lambda: _chain(n, a)) for _ in range(5)])
    target = np.median([_timed(prefill) for _ in range(5)])
    n = max(1, int(n * target / took))
    _, c0, c1 = _block(0, 1536, TASKS_PER_THREAD * threads, COLUMN_ALIGN)  # the prefill's first column block
    width = c1 - c0
    x_blocks = rng.standard_normal((threads, 256, 576), dtype=np.float32)  # (T, M, K): the prefill's x per thread
    w_blocks = rng.standard_normal((threads, width, 576), dtype=np.float32)  # (T, width, K): a block of its w
    products = np.empty((threads, 256, width), dtype=np.float32)  # (T, M, width)

    def private_products(repeats):
        with single_threaded_blas():  # steers the workers, as batched_matmul's regions
            _private_products(x_blocks, w_blocks, products, repeats)

    private_products(1)  # compile
    repeats = max(1, round(target / np.median([_timed(lambda: private_products(1)) for _ in range(5)])))

    def on_the_pool():
        steer_workers()
        _chains(n, a, out)

    words = rng.standard_normal((4096 * 4096) // 4, dtype=np.float32)  # the bytes of a 4096² int8 weight

    def read():  # the all-core read that simulator.calibrate times
        steer_workers()
        read_once(words)

    read()  # compile

    def on_one_thread():
        with serial_if_small():  # no work counted: Numba's loops on the calling thread alone
            prefill()

    on_one_thread()  # warm

    return {"control multiply-adds, calling thread": lambda: _chain(n, a),
            f"control multiply-adds, {threads} threads": on_the_pool,
            f"control private products, {threads} threads": lambda: private_products(repeats),
            "control dense prefill, calling thread": on_one_thread,
            f"control read 16 MiB, {threads} threads": read}


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _decode_rate(model, prompt, tokens):
    timings = {}
    out = model.generate(prompt, tokens, timings=timings)
    return len(out) / timings["decode_s"]


DECODE_TOKENS = 48  # tokens of a decode round (~0.25 s on two cores)
READY = "ready"  # what a serving process writes when it waits for its first round (``_serve``)


def _load_model():
    """SmolLM2 in int8 with the int8 LM head, its decode step compiled; a prompt; an all-core read's buffer of a
    DRAM size (``simulator.calibrate.dram_test_bytes``)."""
    from models.smollm2 import SmolLM2
    from simulator.calibrate import dram_test_bytes, filled

    model = SmolLM2(linear="int8", quantize_lm_head=True)
    prompt = model.encode("Once upon a time")
    model.generate(prompt, 4)  # compile
    return model, prompt, filled(dram_test_bytes() // 4, 1.0, np.float32)


def _serve(model, prompt, read_buffer, commands, answers):
    """Decode rounds on request: writes READY, then for each line "round" of ``commands`` runs one round of
    DECODE_TOKENS tokens followed by the reads beside it (``helpers.beside_reads``: the best single all-core pass
    and a read as long as the round) and answers [rate, read, sustained read] as a JSON line; stops at "done" (or
    the end of ``commands``). Returns the rounds' [rates, reads, sustained reads]."""
    from helpers import beside_reads, sustained_read

    round_bytes = DECODE_TOKENS * model.weight_bytes_per_token()
    rounds = [[], [], []]
    print(READY, file=answers, flush=True)
    for line in commands:
        if line.strip() != "round":
            break
        (rate,), (read,), (sustained,) = beside_reads(lambda: _decode_rate(model, prompt, DECODE_TOKENS),
                                                      read_buffer, 1, lambda: sustained_read(read_buffer, round_bytes))
        for values, value in zip(rounds, (rate, read, sustained)):
            values.append(value)
        print(json.dumps([rate, read, sustained]), file=answers, flush=True)
    return rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--decode", action="store_true",
                        help="load SmolLM2 first; after the rounds, serve decode rounds on stdin/stdout")
    parser.add_argument("--decode-only", action="store_true",
                        help="load SmolLM2 and serve decode rounds at once (no kernel rounds)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-first", action="store_true",
                        help="import torch before kernels (its OpenMP runtime is then the one Numba uses)")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="sleep this long before each call (a program that pauses between calls)")
    args = parser.parse_args(argv)

    use_torch = not args.no_torch
    if not args.torch_first:
        import kernels
    if use_torch:
        try:
            import torch  # noqa: F401  (imported in the fresh process too: its import alone sets threading)
        except ImportError:
            use_torch = False
    import kernels

    result = {"pool": kernels.pool_info(), "torch": use_torch}
    decode = args.decode or args.decode_only
    protocol = sys.stdout  # the decode rounds' requests and answers (``_serve``); anything else printed goes to stderr
    if decode:
        sys.stdout = sys.stderr
        model, prompt, read_buffer = _load_model()
        result["weight_bytes_per_token"] = model.weight_bytes_per_token()
        result["tasks_per_thread"] = model._one_region_step().tasks_per_thread  # its step's tuning chose it
    if not args.decode_only:
        rng = np.random.default_rng(0)
        calls = _calls(rng, use_torch)
        for fn in calls.values():  # compile and warm
            fn()
            fn()
        if not args.pause_ms:  # the controls are for the spread of calls back to back
            calls.update(_controls(calls["dense prefill 256×576→1536"], kernels.pool_info()["threads"]))
        samples = {name: [] for name in calls}
        numpy_pool_s = {name: [] for name in calls}  # the CPU seconds NumPy's BLAS workers used during each call
        for _ in range(args.rounds):
            for name, fn in calls.items():
                if args.pause_ms:
                    time.sleep(args.pause_ms / 1e3)
                before = _cpu_s(NUMPY_POOL)
                samples[name].append(_timed(fn))
                numpy_pool_s[name].append(_cpu_s(NUMPY_POOL) - before)
        result["samples_s"] = samples
        result["numpy_pool"] = {"threads": len(NUMPY_POOL), "cpu_s": numpy_pool_s}
    if decode:
        result["decode_rounds"] = _serve(model, prompt, read_buffer, sys.stdin, protocol)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
