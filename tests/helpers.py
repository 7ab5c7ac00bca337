"""Helpers the test files share (imported as ``tests.helpers``; ``pythonpath = .`` in setup.cfg makes ``pytest``
and ``python -m pytest`` alike find it): the comparison with an oracle under ``kernels.tolerances``, attention done
plainly in low precision, the inputs and bad calls that several tiers' tests reuse, a block on a set number of
Numba threads, the flags of the memory mapping that holds an address, and the lock that lets a test time the machine
while pytest-xdist runs the others."""
from __future__ import annotations

import contextlib
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from kernels.tolerances import LOW_PRECISION_FACTOR, TOLERANCES as _BY_NAME, UNIT_ROUNDOFF as _ROUNDOFF_BY_NAME

TOLERANCES = {np.dtype(name): tol for name, tol in _BY_NAME.items()}  # keyed by NumPy dtype here


def assert_close(actual, reference, dtype, plain=None, scale=1.0):
    """Compare with the oracle under ``kernels.tolerances``: in full precision |x − ref| <= atol · scale + rtol ·
    |ref| (``scale``: the size of what was summed, max |ref| for a matmul); float16 and bfloat16 (the latter by
    name) by flash-attn's rule against ``plain``, the same computation done plainly in that precision."""
    name = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape
    assert np.array_equal(np.isnan(actual), np.isnan(reference)), "NaN pattern differs from the oracle"
    finite = np.isfinite(reference)
    assert np.array_equal(np.isfinite(actual), finite), "inf pattern differs from the oracle"
    assert np.array_equal(actual[~finite & ~np.isnan(reference)], reference[~finite & ~np.isnan(reference)])
    err = np.abs(actual[finite] - reference[finite])
    if name in _BY_NAME:
        tol = _BY_NAME[name]
        bound = tol["atol"] * scale + tol["rtol"] * np.abs(reference[finite])
        worst = np.argmax(err - bound) if err.size else None
        assert np.all(err <= bound), (f"max error {err.max():.3g} exceeds atol {tol['atol']}·{scale:.3g} + rtol "
                                      f"{tol['rtol']}·|ref| at |ref|={np.abs(reference[finite])[worst]:.3g}")
    else:
        plain_err = np.abs(np.asarray(plain, dtype=np.float64)[finite] - reference[finite]).max(initial=0.0)
        bound = (LOW_PRECISION_FACTOR * plain_err
                 + _ROUNDOFF_BY_NAME[name] * np.abs(reference).max(initial=0.0))
        assert err.max(initial=0.0) <= bound, f"error {err.max():.3g} > 2 × plain {name} error {plain_err:.3g}"


def plain_attention(q, k, v, causal):
    """Attention done plainly in the inputs' own precision (for flash-attn's low-precision rule)."""
    dt = q.dtype
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * dt.type(1 / np.sqrt(q.shape[-1]))  # (B, Hq, Nq, Nk)
    nq, nk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, dt.type(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), dt.type(0), m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return (p / np.where(l == 0, dt.type(1), l)) @ v


def attention_inputs(rng, hq=4, hkv=2, n=8, d=16, dtype=np.float32):
    """Valid small q, k, v (GQA) for the bad-call tests to spoil."""
    q = rng.standard_normal((1, hq, n, d)).astype(dtype)
    k = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    v = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    return q, k, v


def bad_attention_calls():
    """(id, exception, message pattern, function of (q, k, v) returning (args, kwargs))."""
    return [
        ("head-dim-mismatch", ValueError, "head dims differ",
         lambda q, k, v: ((q[..., :8], k, v), {})),
        ("kv-shape-mismatch", ValueError, "k and v must have the same shape",
         lambda q, k, v: ((q, k, v[:, :, :5]), {})),
        ("heads-not-multiple", ValueError, "multiple of the number of key/value heads",
         lambda q, k, v: ((q[:, :3], k, v), {})),
        ("batch-mismatch", ValueError, "batch sizes differ",
         lambda q, k, v: ((np.concatenate([q, q]), k, v), {})),
        ("ndim-1", ValueError, "q must have 2, 3 or 4 dimensions",
         lambda q, k, v: ((q[0, 0, 0], k, v), {})),
        ("ndim-5", ValueError, "k must have 2, 3 or 4 dimensions",
         lambda q, k, v: ((q, k[None], v[None]), {})),
        ("ndim-differs", ValueError, "same number of dimensions",
         lambda q, k, v: ((q[0], k, v), {})),
        ("int-dtype", TypeError, "q must have a floating dtype",
         lambda q, k, v: ((q.astype(np.int32), k, v), {})),
        ("complex-dtype", TypeError, "v must have a floating dtype",
         lambda q, k, v: ((q, k, v.astype(np.complex64)), {})),
        ("mixed-dtype", TypeError, "must share one dtype",
         lambda q, k, v: ((q, k.astype(np.float64), v), {})),
        ("not-an-array", TypeError, "k must be a numpy.ndarray",
         lambda q, k, v: ((q, k.tolist(), v), {})),
        ("zero-head-dim", ValueError, "head dim",
         lambda q, k, v: ((q[..., :0], k[..., :0], v[..., :0]), {})),
        ("block_q-zero", ValueError, "block_q must be >= 1",
         lambda q, k, v: ((q, k, v), {"block_q": 0})),
        ("block_k-negative", ValueError, "block_k must be >= 1",
         lambda q, k, v: ((q, k, v), {"block_k": -4})),
        ("block_q-float", TypeError, "block_q must be an int",
         lambda q, k, v: ((q, k, v), {"block_q": 16.0})),
        ("scale-zero", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": 0.0})),
        ("scale-negative", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": -0.1})),
        ("scale-nan", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": float("nan")})),
        ("scale-inf", ValueError, "scale must be finite and > 0",
         lambda q, k, v: ((q, k, v), {"scale": float("inf")})),
        ("scale-string", TypeError, "scale must be a real number",
         lambda q, k, v: ((q, k, v), {"scale": "0.1"})),
        ("causal-not-bool", TypeError, "causal must be a bool",
         lambda q, k, v: ((q, k, v), {"causal": "yes"})),
        ("unknown-backend", ValueError, "unknown backend 'gpu'; known: 'auto', 'cpu'",
         lambda q, k, v: ((q, k, v), {"backend": "gpu"})),
    ]


def planted_int8(rng, m, k, n, n_outliers, magnitude=(20, 60)):
    """x (m, k) with ``n_outliers`` hidden dimensions of large magnitude (the emergent features LLM.int8()
    targets), and a weight w (n, k) = (out, in)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    cols = rng.choice(k, n_outliers, replace=False)
    x[:, cols] = rng.uniform(*magnitude, (m, n_outliers)).astype(np.float32) * rng.choice([-1, 1], (m, n_outliers))
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # (out, in)
    return x, w, np.sort(cols)


# (id, exception, message pattern, function of (x, w) returning (args, kwargs)) for kernels.int8
BAD_INT8_CALLS = [
    ("x-nan", ValueError, "x contains NaN", lambda x, w: ((np.where(x > 1, np.nan, x), w), {})),
    ("w-inf", ValueError, "w contains NaN or ±inf", lambda x, w: ((x, np.where(w > 1, np.inf, w)), {})),
    ("k-mismatch", ValueError, "x has K = 63", lambda x, w: ((x[:, :63], w), {})),
    ("w-ndim", ValueError, "w must be 2-D", lambda x, w: ((x, w[0]), {})),
    ("x-int", TypeError, "x must have a floating dtype", lambda x, w: ((x.astype(np.int32), w), {})),
    ("w-list", TypeError, "w must be a numpy.ndarray", lambda x, w: ((x, w.tolist()), {})),
    ("threshold-negative", ValueError, "threshold must be >= 0", lambda x, w: ((x, w), {"threshold": -1.0})),
    ("threshold-nan", ValueError, "threshold must be >= 0", lambda x, w: ((x, w), {"threshold": float("nan")})),
    ("threshold-str", TypeError, "threshold must be a real number", lambda x, w: ((x, w), {"threshold": "6"})),
]


@contextlib.contextmanager
def numba_threads(n):
    """Numba's parallel loops on ``n`` threads (at most the pool's) inside the block, the count restored after."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


# whether this OS advises huge pages (``kernels._common.memory.huge_page_empty``): Linux built with transparent huge
# pages (its sysfs directory; Linux kernel documentation, admin-guide/mm/transhuge.rst)
HUGE_PAGES = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
              and os.path.isdir("/sys/kernel/mm/transparent_hugepage"))
NO_HUGE_PAGES = "no transparent huge pages here (Linux's madvise(MADV_HUGEPAGE) and its sysfs directory)"


def vm_flags(address):
    """The VmFlags of the memory mapping that holds ``address`` (Linux's /proc/self/smaps; proc(5))."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms offset ..."
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@contextlib.contextmanager
def session_lock(directory, alone):
    """Under pytest-xdist (the README's ``-n logical``): while a test that times the machine runs (``alone``), the
    other workers wait; other tests run side by side. Each test, from the setup of its fixtures to their teardown,
    holds a shared lock on a file in ``directory``, which all workers see (``conftest.pytest_runtest_protocol``); an
    ``alone`` one holds it exclusively. A second file, the gate, keeps an ``alone`` test from waiting forever: it
    holds the gate while it waits for the running tests to end, and a test takes the gate, briefly, before its
    shared lock, so that none starts meanwhile (flock lets a shared lock in beside one that waits for exclusive
    use). ``directory`` None (no xdist: one test at a time anyway): nothing to lock."""
    if directory is None:
        yield
        return
    import fcntl  # POSIX, where xdist runs these tests

    directory = Path(directory)
    with open(directory / "tests.gate", "a") as gate, open(directory / "tests.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
