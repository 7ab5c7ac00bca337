"""The threading design of ioaware: one pool, Numba's, whose threads sleep when a call returns.

Every parallel loop of the CPU kernels runs on Numba's threads; every BLAS call a kernel makes runs inside one of
those threads, on one BLAS thread (``single_threaded_blas``); no kernel calls NumPy's multithreaded BLAS. So a
call wakes one pool, and when it returns that pool's threads sleep at once:

- Numba's threading layer is OpenMP (the only thread-safe layer without a package of its own; TBB's workers spin
  too, and the workqueue layer aborts when two Python threads launch at once), started with a *passive* wait
  policy: at the end of a parallel region the workers block in the kernel instead of spinning.
- BLAS called from those threads (SciPy's OpenBLAS, which Numba's ``np.dot`` uses) is limited to one thread for
  the duration of the call, so its own pool never wakes.
- Before a region, while no other pool's threads run, the workers' affinity leaves out the CPU of the thread that
  launches it (``affinity.py``, Linux): a VM's guest kernel may otherwise wake a sleeping worker on that very CPU,
  where it waits for the caller.
- A small call runs on the calling thread alone (``serial_if_small``, below), and so does any call while the
  process's other threads (another pool's, spinning after its own call) hold every core but the caller's; a long
  flash attention, KV-pruning scoring or prefill linear layer there runs in parts, looking again before each, and
  goes to the pool once the cores are free (``in_parts``).

Why passive: a spinning worker holds its core for as long as it spins (GNU OpenMP: 300 000 PAUSE instructions by
default, milliseconds on current x86 parts), and a parallel region cannot finish while one of its threads waits
for a core. Measured on a 2-vCPU Intel Xeon (Sapphire Rapids class, KVM), a 64-element parallel loop took
1.6 us back to back but 5-6 ms whenever another pool or process held the second core; SmolLM2 decode fell from
36 to 1.2-3.5 tokens/s with other processes running, where passive waits kept 24.5 tokens/s
(``benchmarks/test_bench_stalls.py`` measures the options). The price is a wake-up per parallel region (tens of
microseconds on a VM), which the kernels keep down by launching few regions per call.

The wait policy is read by the OpenMP runtime once, when it is loaded: ``configure_pool`` sets it for Numba's
runtime only (the environment is restored afterwards, so a torch imported later keeps its own default), and only
where the user has set neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``/``KMP_BLOCKTIME``. If the GNU OpenMP
runtime was already loaded by another package, its policy cannot be changed any more: ``pool_info()`` says so.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Numba tries its layers in this order; OpenMP first (see the module docstring), workqueue where OpenMP is missing
LAYER_PRIORITY = ["omp", "workqueue", "tbb"]

_state: dict = {}
_lock = threading.Lock()


def _openmp_loaded() -> bool:
    """True if the GNU or LLVM/Intel OpenMP runtime Numba links against is already mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if "/" in line}
    return bool(names & {"libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so"})


def configure_pool() -> None:
    """Start Numba's thread pool with the design above (once per process; later calls return at once)."""
    if _state:
        return
    with _lock:
        if _state:
            return
        import numba
        from numba.np.ufunc import parallel

        user_policy = {name: os.environ[name] for name in _POLICY_VARIABLES if name in os.environ}
        started_before = parallel._is_initialized  # by the user's own parallel Numba code
        already_loaded = _openmp_loaded()
        if "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
            numba.config.THREADING_LAYER_PRIORITY = LAYER_PRIORITY
        if not user_policy:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            parallel._launch_threads()
        finally:
            if not user_policy:
                del os.environ["OMP_WAIT_POLICY"]
        layer = numba.threading_layer()
        if user_policy:
            policy = ", ".join(f"{k}={v}" for k, v in user_policy.items()) + " (set by the user)"
        elif started_before:
            policy = "as Numba's pool was started before ioaware was imported (set OMP_WAIT_POLICY=PASSIVE)"
        elif layer != "omp":
            policy = f"the {layer} layer's own"
        elif already_loaded:
            policy = "the OpenMP runtime's default (it was loaded before ioaware; set OMP_WAIT_POLICY=PASSIVE)"
        else:
            policy = "PASSIVE"
        _state.update(layer=layer, wait_policy=policy)


def pool_info() -> dict:
    """What runs ioaware's parallel loops: the threading layer, its thread count, the CPUs its threads may run on
    (fewer than threads: some share a CPU), its wait policy, whether its workers are kept off the calling thread's
    CPU (``affinity.py``), and whether a call runs on the calling thread while other threads hold the other cores
    (``serial_if_small``)."""
    configure_pool()
    import numba

    from .affinity import SUPPORTED, pool_cpu_count, steering

    return {"threading_layer": _state["layer"], "threads": numba.get_num_threads(), "cpus": pool_cpu_count(),
            "wait_policy": _state["wait_policy"], "steer_workers": steering(),
            "serial_when_held": SERIAL_WHEN_HELD and SUPPORTED}


# -- small calls on the calling thread ------------------------------------------------------------------------------
# A parallel region ends when its last thread does, and a woken worker whose core is held (by another pool's
# spinning thread: torch's and NumPy's BLAS pools spin after each call) waits for the scheduler to give it a turn,
# up to a time slice (Linux EEVDF's base slice: 3 ms, ``sched_base_slice_ns``, kernel/sched/fair.c). A call that
# one core finishes in about a millisecond can save less than that risk, so it runs on the calling thread alone:
SERIAL_MULTIPLY_ADDS = 2**24  # ~1 ms or less on one x86 core with AVX2 (16 GFLOP/s and up, 2 FLOPs each); for an
# int8 GEMV (M·K·N, M = 1) the weight's bytes, 16 MB: ~1 ms at the ~15 GB/s one core streams
SERIAL_ELEMENTS = 2**21  # a float32 element pass (read 4 B, write 1-4 B): ~1 ms at the ~10 GB/s one core streams
# Measured, stall benchmark on the 2-vCPU Xeon interleaved with NumPy and torch: flash N=128 causal x8 heads (8.4 M
# multiply-adds) median 1.0 ms, p90 5.9 ms on two threads; alone 0.40 ms on two threads, 0.52 ms on one.
# quantize_vectorwise 128x1024 (131 k elements): alone 0.19 ms on two threads, 0.12 ms on one.


# -- calls beside held cores ---------------------------------------------------------------------------------------
# Where the process's other threads hold every core but the caller's (NumPy's OpenBLAS workers poll for ~0.1 s after
# each of its multithreaded calls), a worker woken beside one of them shares its core, and the scheduler's balancing
# then tends to move the polling thread onto the caller's core, where the two take turns in 4 ms ticks (traced in
# the stall benchmark's rounds on a 2-vCPU Xeon: an element pass on the calling thread 4.0 ms longer, the other vCPU
# idle). So a call of any size then runs on the calling thread alone; a long one (flash attention, the KV-pruning
# scorings, a prefill's linear layers: ``blas.batched_matmul``'s blocks) in parts of PART_MULTIPLY_ADDS (below),
# looking again before each, so that it moves to the pool when NumPy's workers sleep instead of running alone
# throughout (as h2o N=1024 did, twice as long, in the stall benchmark's rounds where it began just before; and the
# dense prefill, which as one call met NumPy's workers in a few rounds only, on one core then and on two otherwise).
# On that Xeon the stall benchmark's worst p90/median of ioaware's calls was 1.28-3.26 in 24 runs of two sessions
# sharing the cores (over 1.5 in 13), 1.18-1.68 in 7 alone without parts (over 1.5 in 3), 1.14-1.76 in 13 alone with
# them (over 1.5 in 4: three times a short call that met NumPy's workers in a few rounds only, once a 0.2 ms call on
# the calling thread), 1.30-1.86 in 6 more with the prefill in parts (over 1.5 in 3, the prefill each time: 9-17 of
# its 30 samples within NumPy's window, most of them wholly). Every run, later ones included: benchmarks/STALLS.md.
# The price: a call wholly within NumPy's window runs on one core (flash N=2048 causal 57-64 ms against 42-49
# sharing). IOAWARE_SERIAL_WHEN_HELD=0 when kernels is imported makes the workers share the held cores instead.
HELD_SWITCH = "IOAWARE_SERIAL_WHEN_HELD"  # "0" when kernels is imported: the workers share held cores
SERIAL_WHEN_HELD = os.environ.get(HELD_SWITCH, "1") != "0"


def _cores_held() -> bool:
    """Whether the process's other threads hold every CPU of the pool but the caller's, and one at least
    (``affinity.cores_held``, ``affinity.pool_cpu_count``); False where it cannot tell. The machine's count of
    runnable threads first (``affinity.runnable_threads``, one read): where it leaves too few beside the caller,
    no look at each thread (about 3 us a thread: 0.4 ms in a process of 132 threads on a 2-vCPU Xeon,
    ``benchmarks/test_bench_threads.py``)."""
    from .affinity import cores_held, pool_cpu_count, runnable_threads

    needed = max(1, pool_cpu_count() - 1)
    runnable = runnable_threads()
    if runnable is not None and 1 <= runnable and runnable - 1 < needed:  # (0: not this kernel's count, unknown)
        return False
    held = cores_held()
    return held is not None and held >= needed


def serial_if_small(multiply_adds: float = 0, elements: float = 0):
    """A context in which Numba's parallel loops run on the calling thread alone when the call's work is below
    both thresholds above (``multiply_adds`` of its products, ``elements`` of its element passes), or, with
    SERIAL_WHEN_HELD, while the process's other threads hold every other core (above); otherwise on the pool as
    set. The thread count is Numba's per-thread setting, so other Python threads are not affected."""
    return _context(_where(multiply_adds, elements))


def _small(multiply_adds, elements) -> bool:
    """Whether a call's work is below both thresholds above: it runs on the calling thread alone."""
    return multiply_adds < SERIAL_MULTIPLY_ADDS and elements < SERIAL_ELEMENTS


def _where(multiply_adds, elements=0) -> str:
    """Where a call of this work runs: "small" (on the calling thread), "held" (on the calling thread, beside held
    cores, with SERIAL_WHEN_HELD) or "pool"."""
    if _small(multiply_adds, elements):
        return "small"
    if SERIAL_WHEN_HELD and _cores_held():
        return "held"
    return "pool"


def _context(where):
    """The context that runs Numba's loops where ``_where`` said."""
    if where != "pool":
        return _OnOneThread(held=where == "held")
    from .affinity import steer_workers

    steer_workers()  # the pool runs the call's regions: its workers off this thread's core (affinity.py)
    return contextlib.nullcontext()


# A long call that runs alone beside held cores looks again after each part of about this much work (~4 ms on one
# x86 core at 16 GFLOP/s, 2 FLOPs each), or of one unit where a unit is more (a (batch, kv head) pair of flash
# attention: 2^28 at N = 2048, causal, d = 64): NumPy's workers sleep ~0.1 s after its last product, and a call that
# began just before then runs the rest of its work on the pool instead of alone throughout (``in_parts``).
PART_MULTIPLY_ADDS = 2**25


def in_parts(units: int, unit_multiply_adds: float, run) -> None:
    """Run a call's work, ``units`` independent units of ``unit_multiply_adds`` each, as ``run(start, stop)`` over
    unit ranges: the whole range at once on the calling thread when the work is small, or on the pool
    (``serial_if_small``); but while the option SERIAL_WHEN_HELD finds the other cores held, a part of about
    PART_MULTIPLY_ADDS at a time on the calling thread, looking again before each next part. ``run(0, units)`` is
    the one call where nothing is held (the option off: always)."""
    start = 0
    while True:
        # (rounded: the work is whole multiply-adds, and a total of exactly SERIAL_MULTIPLY_ADDS passed as units of
        # total / units can come back a hair below it, e.g. in 49, 98 or 196 units, and be taken for small)
        where = _where(round((units - start) * unit_multiply_adds))
        stop = units
        if where == "held":
            stop = min(units, start + max(1, int(PART_MULTIPLY_ADDS // max(unit_multiply_adds, 1))))
        with _context(where):
            run(start, stop)
        if stop == units:
            return
        start = stop


def by_kv_heads(batch, q_heads, kv_heads, head_multiply_adds, whole, part) -> None:
    """``in_parts`` over the (batch, kv head) units of attention-shaped work, each kv head with its query heads (a
    query head's products ``head_multiply_adds``): ``whole()`` for the call at once, else ``part(b, heads, kv)``
    for each batch's run of units (``heads``, ``kv``: slices of the query and kv heads, contiguous in C order)."""
    group = q_heads // max(kv_heads, 1)
    units = batch * kv_heads

    def run(start, stop):
        if (start, stop) == (0, units):
            whole()
            return
        for b, g0, g1 in head_groups(start, stop, kv_heads):
            part(b, slice(g0 * group, g1 * group), slice(g0, g1))

    in_parts(units, group * head_multiply_adds, run)


def head_groups(start: int, stop: int, kv_heads: int):
    """The (batch, first kv head, end kv head) ranges of units [start, stop) numbered batch-major over ``kv_heads``
    kv heads a batch (``in_parts`` over attention's heads: each range a contiguous slice of a C-ordered array)."""
    while start < stop:
        b, g0 = divmod(start, kv_heads)
        g1 = min(kv_heads, g0 + stop - start)
        yield b, g0, g1
        start += g1 - g0


_outer = threading.local()  # the calling thread's count outside its calls on one thread (``pool_threads``)


def pool_threads() -> int:
    """The thread count a call plans its work for (flash's tiles and key splits, ``blas.batched_matmul``'s blocks):
    Numba's, but in a call that runs alone beside held cores the pool's, as set outside it, so that its results are
    the same bits whether it runs alone or on the pool. (A small call plans for its one thread; a call run through
    ``in_parts`` plans with ``planned_threads``.)"""
    import numba

    count = getattr(_outer, "count", None)
    return numba.get_num_threads() if count is None else count


def planned_threads(multiply_adds: float = 0, elements: float = 0) -> int:
    """The thread count that a call of this work run through ``in_parts`` plans for: one where it is small (as
    ``serial_if_small`` would run it), else the pool's (``pool_threads``), wherever its parts then run."""
    if _small(multiply_adds, elements):
        return 1
    return pool_threads()


class _OnOneThread:
    """Numba's loops on the calling thread for the block; ``held``: a call that would run on the pool but for held
    cores, which plans its work for the pool (``pool_threads``)."""

    def __init__(self, held=False):
        self.held = held

    def __enter__(self):
        import numba

        self.previous = numba.get_num_threads()
        self.outermost = self.held and getattr(_outer, "count", None) is None
        if self.outermost:
            _outer.count = self.previous
        numba.set_num_threads(1)

    def __exit__(self, *exc):
        import numba

        numba.set_num_threads(self.previous)
        if self.outermost:
            _outer.count = None
        return False
