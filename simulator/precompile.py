"""Compile the kernels a report runs before it measures anything, on all cores at once.

Why: Numba compiles a kernel at its first call, one kernel at a time (its compiler holds one lock per process), and
keeps the machine code in its on-disk cache, which any change to the packages' sources makes stale
(``kernels/_common/numba_cache.py``). So a fresh clone's first report, and the first after every ``git pull``,
compiles everything on one core: on a 2-vCPU AMD EPYC (Zen 3, family 25 model 1, KVM) ``report --quick`` took
162-165 s in two such runs against 47.5 s once the cache was warm, and Numba's compile events
(``numba.core.event``, "numba:compile") added up to 116-118 s, in four kernels above all: the decode step's region
(38-44 s), the flash kernel (16-18 s), the calibration's int8 step rows (11-12 s) and the int8 split GEMV (4-5 s).

Here the kernels are grouped in JOBS, each run by one process: the report's own (the largest share) and, beside
it, as many more as the machine has cores for (``plan``). A job compiles its kernels by calling them once on small
inputs of the types the report gives them: Numba compiles one machine code per argument types (dtype, dimensions,
layout), whatever the sizes. The other processes write what they compile into Numba's cache, from which the
report's process loads it at its first call. A kernel no job reaches is compiled where the report first calls it,
as before, and a job whose kernels are all in the cache (``needed``) does not run, so a warm run starts no process.
Nothing a job computes is kept; it measures nothing the report uses. To ask the cache, ``needed`` names a few of
each job's kernels (``JOBS``' sentinels), private functions of ``kernels`` among them: the compiled functions
themselves, which no public name reaches.

Measured on the Zen 3 above, in a fresh clone with Numba's cache emptied (at 0161371, the decode step in one
compiled function): ``report --quick`` 92 and 97 s in two runs, the compile step 49 and 50 s of them (two
processes), against 3 min 3 s when each kernel compiled at its first call; 40 s once the cache was warm.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import time
import warnings

import numpy as np


def _decode_step():
    """The decode step's one region (``kernels.decode.LlamaDecodeStep``) as SmolLM2 runs it: int8 blocks (int8
    weights only) and float32 ones with the tied float32 LM head, greedy decoding and one call, and the step's
    fixed part (``fixed_seconds``, the report's prediction)."""
    from kernels import decode
    from kernels.int8 import Int8Linear

    rng = np.random.default_rng(0)
    L, hq, hkv, d, inter, vocab = 1, 2, 1, 8, 16, 11  # blocks, query and kv heads, head_dim, intermediate, vocab
    H = hq * d
    shapes = ((hq + 2 * hkv) * d, H), (H, H), (2 * inter, H), (H, inter)  # wqkv, wo, w_gate_up, w_down (out, in)
    head = rng.standard_normal((vocab, H), dtype=np.float32)  # (vocab, H)
    norms = rng.uniform(0.5, 2.0, (3, L, H)).astype(np.float32)  # (attn, ffn, final) × (L, H)
    embedding = rng.standard_normal((vocab, H), dtype=np.float32)  # (vocab, H)
    for int8 in (True, False):
        weights = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
        block = tuple(Int8Linear.from_float(w) if int8 else w for w in weights)
        step = decode.LlamaDecodeStep([block], norms[0], norms[1], norms[2][0], head, n_heads=hq, n_kv_heads=hkv,
                                      head_dim=d, eps=1e-5)
        keys, values = (np.zeros((L, hkv, 4, d), np.float32) for _ in range(2))  # (L, Hkv, capacity, d)
        cos, sin = np.ones((2, d // 2), np.float32), np.zeros((2, d // 2), np.float32)  # (tokens, d/2)
        step.greedy(1, 2, embedding, cos, sin, keys, values, np.zeros(L, np.int64))
        step(embedding[0].copy(), cos[0], sin[0], keys, values, [2])
        step.fixed_seconds(1, calls=1)


def _flash():
    """``kernels.attention``'s flash kernel: causal and not, a prefill (one block of queries per head) and a decode
    call (one query against a cache long enough to split its keys, ``combine_splits``), MHA and GQA."""
    import kernels

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32) for _ in range(3))  # (B, H, N, d)
    for causal in (False, True):
        kernels.attention(q, k, v, causal=causal, algorithm="flash")
        kernels.attention(q, k[:, :2].copy(), v[:, :2].copy(), causal=causal, algorithm="flash")  # GQA, 2 kv heads
    k_long, v_long = (rng.standard_normal((1, 2, 8192, 64), dtype=np.float32) for _ in range(2))  # (B, Hkv, N, d)
    kernels.attention(q[:, :, :1].copy(), k_long, v_long, causal=True)  # decode: (1, Hq, 1, d)


def _calibration():
    """The calibration's own micro-kernels (``simulator.calibrate``, ``simulator.calibrate_phases``), through the
    functions that time them, on arrays of a few kilobytes to a megabyte (milliseconds of timing each)."""
    import numba

    from . import calibrate, calibrate_phases as phases

    threads = numba.get_num_threads()
    buffer = calibrate.filled(2**18, 1.0, np.float32)  # (2^18,), 1 MiB: fill_parallel
    calibrate.read_bandwidth_of(buffer, repeats=1)
    calibrate.triad_bandwidth_of(buffer, repeats=1)
    calibrate.cache_triad_bandwidth(2**12, repeats=1)
    calibrate.launch_overhead()
    _, sizes, _ = phases.llc_curve(buffer, 2**17)  # one core's reads over 256 KiB .. 1 MiB
    phases.llc_curve_all(buffer, sizes, threads, 2**17)
    br, bc, d = 4, 8, 16
    q_i, pv, o_acc = (np.ones((threads, br, d), np.float32) for _ in range(3))  # (threads, Br, d)
    k_j, v_j = (np.ones((threads, bc, d), np.float32) for _ in range(2))  # (threads, Bc, d)
    s, p = (np.ones((threads, br, bc), np.float32) for _ in range(2))  # (threads, Br, Bc)
    alpha = np.ones((threads, br), np.float32)  # (threads, Br)
    phases.block_steps(q_i, k_j, v_j, s, p, pv, o_acc, alpha, 1)
    phases.exp_rows(s, p, 1)
    phases.max_rows(s, 1)
    phases.rescale_rows(o_acc, pv, alpha, 1)


def _calibration_rows():
    """The calibration's copies of the decode step's row kernels, float32 and int8 (``decode_step_rates``)."""
    import numba

    from . import calibrate, calibrate_phases as phases

    phases.decode_step_rates(calibrate.filled(2**18, 1.0, np.float32), numba.get_num_threads())


def _int8():
    """``Int8Linear`` on one row and on several, with outlier features and without, with the float16 copy of the
    weights and without; the naive absmax matmul; the float32 GEMV of ``kernels.dense``."""
    from kernels.dense import matmul_nt
    from kernels.int8 import Int8Linear, naive_absmax_matmul

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128), dtype=np.float32)  # (N, K)
    x = rng.standard_normal((8, 128), dtype=np.float32)  # (rows, K)
    x[:, 5:7] = 40.0  # two outlier features (|x| >= the threshold, 6): several rows of them make an F-ordered copy
    for keep in (False, True):
        layer = Int8Linear.from_float(w, keep_fp16_weights=keep)
        for rows in (x[:1], x, x[:1] / 40, x / 40):  # one row, several; with the outlier features, without
            layer(rows)
    naive_absmax_matmul(x, w)
    matmul_nt(x[:1], w)
    matmul_nt(x, w)


def _standard_and_pruning():
    """The standard attention algorithm and its phases; SnapKV, H2O and StreamingLLM; the GGUF's dequantization
    (``models.gguf_dequant``)."""
    import kernels
    from kernels import kvprune
    from models import gguf_dequant

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32) for _ in range(3))  # (B, H, N, d)
    for causal in (False, True):
        kernels.attention(q, k, v, causal=causal, algorithm="standard")
        kernels.attn.standard_phase_times(q, k, v, causal=causal)
    kvprune.snapkv_compress(q, k, v, capacity=64)
    kvprune.streaming_llm(q, k, v, capacity=64)
    kvprune.h2o(q, k, v, capacity=64)
    for kind, block_bytes in ((gguf_dequant.Q4_1, gguf_dequant.Q4_1_BYTES),
                              (gguf_dequant.Q8_0, gguf_dequant.Q8_0_BYTES)):
        blocks = np.zeros((2, block_bytes), np.uint8)  # (rows, bytes per row): two blocks of zeros
        blocks.flags.writeable = False  # as the GGUF file's memory map gives them
        gguf_dequant.dequantize(blocks, kind)


def _split_gemv_module() -> str:
    """The module whose split GEMV this CPU runs on several rows (``kernels.int8._api._split_gemv``): ``_vnni``'s
    where its products take AVX512-VNNI's ``vpdpbusd``, else the portable kernel. With the portable one as the
    sentinel on a VNNI CPU (it never compiles there), the int8 job ran before every report, its kernels all cached."""
    from kernels.int8 import product_path

    return "kernels.int8._vnni" if product_path() == "vpdpbusd" else "kernels.int8._numba_cpu"


# name: (the job, its sentinels: the kernels whose compile dominates it, as module (or a function that names the one
# this CPU runs) and function, and its seconds alone from an empty cache, each job in a process of its own, on the
# 2-vCPU Intel Xeon (AVX-512 with VNNI; 2026-12-05): only to balance ``plan``. There the six jobs of 5-16 s share two
# processes as 27.9 and 24.7 of their 52.6 s, where the four jobs before them put 31 s in one process)
JOBS = {
    "decode step": (_decode_step, (("kernels.decode._step", "_tokens"),), 15.9),
    "int8": (_int8, ((_split_gemv_module, "split_gemv"),), 12.1),
    "standard attention and pruning": (_standard_and_pruning, (("kernels._common.blas", "_batched_nt"),
                                                               ("kernels.kvprune._numba_cpu", "window_scores")),
                                       6.9),
    "flash attention": (_flash, (("kernels.attn._numba_cpu", "flash_forward"),
                                 ("kernels.attn._numba_cpu", "combine_splits")), 6.7),
    "calibration": (_calibration, (("simulator.calibrate_phases", "block_steps"),
                                   ("simulator.calibrate", "_read_sum")), 5.7),
    "calibration rows": (_calibration_rows, (("simulator.calibrate_phases", "_step_int8"),), 5.3),
}


def cached(dispatcher) -> bool:
    """Whether Numba's cache holds machine code of the njit function ``dispatcher`` for this CPU and these
    sources (any argument types). False where the function is not cached, where its index cannot be read (a
    partly written or unreadable file), or where this Numba keeps its cache otherwise than 0.68 does
    (``numba.core.caching``: an index file of (signature, CPU, bytecode hashes) keys, emptied where the source
    file's stamp changed)."""
    try:
        index = dispatcher._cache._cache_file._load_index()  # {} where the sources changed (the stamp differs)
        key = dispatcher._cache._index_key(None, dispatcher.targetctx.codegen())  # (sig, CPU, bytecode hashes)
    except (AttributeError, TypeError, OSError, EOFError, pickle.UnpicklingError):
        return False
    return any(entry[1:] == key[1:] for entry in index)


def sentinel(module, function):
    """The njit function a sentinel of JOBS names."""
    import importlib

    return getattr(importlib.import_module(module() if callable(module) else module), function)


def needed() -> list[str]:
    """The jobs of JOBS with a sentinel that Numba's cache does not hold."""
    def sentinels_cached(name):
        return all(cached(sentinel(*named)) for named in JOBS[name][1])

    return [name for name in JOBS if not sentinels_cached(name)]


def plan(names, processes: int) -> list[list[str]]:
    """``names`` split over at most ``processes`` processes, largest job first, each to the process with the least
    estimated seconds so far (the longest-processing-time rule); the first list is the largest share."""
    bins = [[] for _ in range(max(1, min(processes, len(names))))]
    seconds = [0.0] * len(bins)
    for name in sorted(names, key=lambda name: -JOBS[name][2]):
        i = seconds.index(min(seconds))
        bins[i].append(name)
        seconds[i] += JOBS[name][2]
    order = sorted(range(len(bins)), key=lambda i: -seconds[i])
    return [bins[i] for i in order if bins[i]]


def run_jobs(names) -> None:
    """Run the jobs ``names`` in this process, in order."""
    _call([JOBS[name][0] for name in names])


def _call(functions) -> None:
    for function in functions:
        function()


def precompile(processes: int | None = None) -> dict:
    """Run the jobs that are ``needed``, over ``processes`` processes (default: the CPUs this process may run on),
    this one included, and wait for all. Returns {"jobs": their names, "processes": the processes that ran them,
    "failed": the jobs whose process failed, "seconds": the wall time}.

    A job's failure here raises, as any call of its kernels would. Another process that fails (an exception, whose
    traceback it prints, or the process killed: its exit status is not 0) leaves its jobs' kernels to compile at
    their first call, as without this step, with a ``RuntimeWarning`` naming them. Where no process can be started
    (``OSError``) this one runs the jobs meant for it, with a ``RuntimeWarning``. Stopped (Ctrl-C, a signal turned
    into SystemExit), it ends the other processes before the exception leaves."""
    start = time.perf_counter()
    names = needed()
    if processes is None:
        processes = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bins = plan(names, processes)
    # spawned, not forked: a fork would copy this process's Numba threads' state (and its compiler lock)
    context = multiprocessing.get_context("spawn")
    others, failed = [], []
    try:
        try:
            for share in bins[1:]:
                other = context.Process(target=_call, args=([JOBS[name][0] for name in share],), daemon=True)
                other.start()
                others.append((share, other))
        except OSError as err:
            warnings.warn(f"no process could be started to compile in ({err}): this one compiles the rest",
                          RuntimeWarning, stacklevel=2)
        started = {name for share, _ in others for name in share}
        run_jobs([name for share in bins for name in share if name not in started])  # its share, and any left
        for share, other in others:
            other.join()
            if other.exitcode != 0:
                failed += share
    except BaseException:
        for _, other in others:
            other.terminate()
        raise
    finally:
        for _, other in others:
            other.join()
    if failed:
        warnings.warn(f"compiling the kernels of {', '.join(failed)} failed in another process: they compile at "
                      f"their first call", RuntimeWarning, stacklevel=2)
    return {"jobs": names, "processes": 1 + len(others) if names else 0, "failed": failed,
            "seconds": time.perf_counter() - start}


if __name__ == "__main__":  # python -m simulator.precompile: compile what a report needs, then say what ran
    summary = precompile()
    print(f"compiled {', '.join(summary['jobs']) or 'nothing (all cached)'} in {summary['processes']} processes, "
          f"{summary['seconds']:.1f} s", file=sys.stderr)
