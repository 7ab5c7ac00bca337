"""Numba's worker threads kept off the core of the thread that launches a parallel region (Linux).

Why: a worker that sleeps between calls (the pool's passive wait, ``threads.py``) is woken by the calling thread
at the next region. After a pause of the calling program, the guest kernel of a VM woke it on the caller's own
vCPU (seen with ``sched_getcpu()`` in each iteration), where it started when the caller's time slice ended or the
load balancer moved it, milliseconds later: the region ran on one core. The likely reason: Linux wakes a task on
an idle CPU where it finds one (``select_idle_sibling``, kernel/sched/fair.c), and does not count as idle a vCPU
that the host reports preempted (``available_idle_cpu`` asks ``vcpu_is_preempted``).

Only while the process's other threads are quiet: where threads other than the caller and its workers ran since
the clocks were last read (another pool's, which may still spin on the other CPUs: NumPy's OpenBLAS for ~0.1 s
after a call), a worker held to those CPUs waits for them, up to a time slice, where the scheduler would have placed
it elsewhere. Narrowed before every region of the stall benchmark (``benchmarks/test_bench_stalls.py``: ioaware's
calls between NumPy's and torch's), ``Int8Linear``'s GEMV at 4096² met stalls of 6-7 ms; so the workers get their
own affinities back whenever those threads used more than QUIET_SHARE of a core per worker (``_others_busy``: the
process's CPU clock less this thread's and each worker's).

Measured on a 2-vCPU AMD EPYC (Zen 4, KVM). A parallel loop of two 1.1 ms iterations after 100 ms sleeps (medians of
20): the worker started 1.15 ms late, on the caller's vCPU, and the loop took 2.26 ms; with the caller and the
worker pinned to one vCPU each, 0.12 ms late and 1.26 ms. Each call 50 ms after the last
(``benchmarks/test_bench_stalls.py::test_calls_after_pauses``, two runs), the median off over on: a prefill's linear
(256, 576) · (576, 1536) 1.55 and 1.69, ``h2o`` N = 1024 1.15 and 1.22, ``snapkv_compress`` N = 4096 1.11 and 1.20,
``int8_matmul`` 128 × 1024² 1.08 and 1.15, flash N = 2048 causal 0.92 and 1.12. The stall benchmark, two runs each
way (on / off): ioaware's worst p90/median 1.35 and 1.45 / 1.68 and 1.62, the dense prefill's 1.11 and 1.06 / 1.65
and 1.62, ``Int8Linear`` 4096²'s slowest call 1.0 and 1.5 / 1.6 and 1.0 ms; SmolLM2's decode after the kernels 230
and 229 / 195 and 228 tokens/s.

How: the workers' thread ids are read once per calling thread and pool size, by a parallel region whose every
iteration asks ``gettid()`` (GNU OpenMP keeps one pool of workers per thread that launches regions), with each
worker's own affinity. Before a region, while the other threads are quiet, ``steer_workers`` compares the caller's CPU
(``sched_getcpu()``) with the one it saw last; when it moved, each worker's affinity becomes its own less that CPU
(``sched_setaffinity``, one system call per worker). A worker keeps its own affinity where that would leave fewer
CPUs than there are workers (more threads than cores: the scheduler shares the cores better than a fixed set
would) or would not change it (threads bound by ``OMP_PROC_BIND``). The affinities stay set until a region that
finds other threads busy (a region of the user's own Numba code on the same thread runs with them too).
``IOAWARE_STEER_WORKERS=0`` when kernels is imported turns it off, as does ``ENABLED = False`` later (the workers
get their own affinities back at the next call); outside Linux, or where the C library has no ``gettid`` (glibc
before 2.30), it is off. ``kernels.pool_info()["steer_workers"]`` says whether it is on for the calling thread.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import NumbaError
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _parallel

ENV_SWITCH = "IOAWARE_STEER_WORKERS"
QUIET_SHARE = 0.25  # the CPU time of the process's other threads (not the caller, not its workers) per worker and
# second of wall time, below which the process was quiet: its other vCPUs idle (where a guest kernel may count them
# preempted). A spinning pool uses a whole core per thread, far above; a quarter leaves room for short bursts of
# other threads (Python's, a logger's) without calling the process busy
ANSWER_AGE_S = 0.05  # the longest a string of calls less than QUIET_GAP_S apart reuses an answer
QUIET_GAP_S = 0.002  # a region within this of the last one finds its workers just run: placed where they ran
# (on the 2-vCPU AMD EPYC, a worker woken 1 ms after its last region started on time; after 5 ms it was late)
DISCOVERY_TRIES = 20  # regions run to see every worker at least once (each takes one iteration of a static split)


def _libc():
    """The C library of this process, on Linux (elsewhere None: ``ctypes.CDLL(None)`` is Linux's and macOS's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return None


_LIBC = _libc()
SUPPORTED = (_LIBC is not None and hasattr(os, "sched_setaffinity") and hasattr(_LIBC, "gettid")
             and hasattr(_LIBC, "sched_getcpu"))
if SUPPORTED:
    _sched_getcpu = _LIBC.sched_getcpu
    _sched_getcpu.restype, _sched_getcpu.argtypes = ctypes.c_int, []


@intrinsic
def _gettid(typingctx):
    """The calling thread's id (``gettid()``, glibc >= 2.30)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "gettid")
        return builder.sext(builder.call(fn, []), ir.IntType(64))

    return sig, codegen


@njit(parallel=True, cache=True)
def _thread_ids(out):
    """out[i] = the id of the thread that runs iteration i (one iteration per thread: the static split)."""
    for i in prange(out.size):
        out[i] = _gettid()


ENABLED = os.environ.get(ENV_SWITCH, "1") != "0"  # read once, at import: a lookup in os.environ takes ~0.9 us


def enabled() -> bool:
    """Whether ``steer_workers`` sets affinities in this process (``ENABLED``: the switch when kernels was
    imported, or as set since)."""
    return SUPPORTED and ENABLED


def _pool_size() -> int:
    """Numba's thread count for this thread: its threading layer's own getter once the pool runs (130 ns against
    850 for ``numba.get_num_threads``, which checks the pool's start under a lock first)."""
    getter = getattr(_parallel, "_get_num_threads", None)
    return getter() if getter is not None and _parallel._is_initialized else numba.get_num_threads()


class _Workers(threading.local):
    """What steering knows of the calling thread's workers (``threading.local`` runs __init__ in each thread)."""

    def __init__(self):
        self.pid = 0  # the process the ids were read in: a forked child has none of its parent's workers, and
        # setting the affinity of a thread id outside the process would move another process's thread
        self.threads = 0  # the pool size the ids were read for
        self.ids = ()  # the workers' thread ids; empty when they could not all be told apart (steering off)
        self.own = {}  # thread id -> its affinity when first read in this process (a worker that outlives a resize
        # of its pool is read again narrowed: its own affinity is the one first read)
        self.masks = ()  # the workers' own affinities, in the order of ids: what a steer narrows, a restore sets
        self.cpu = -1  # the caller's CPU the affinities were last narrowed for; -1 while the workers hold their own
        self.wall = 0.0  # perf_counter at the last region's start
        self.clock_wall = 0.0  # perf_counter when the CPU clocks were last read (0: never)
        self.others = 0.0  # the CPU seconds of the process's other threads then
        self.busy = True  # the last answer of ``_others_busy`` (busy before the clocks were first read)


_workers = _Workers()


def _read_ids(threads):
    own = threading.get_native_id()
    seen: set[int] = set()
    for _ in range(DISCOVERY_TRIES):
        out = np.zeros(threads, dtype=np.int64)  # (threads,)
        _thread_ids(out)
        seen.update(int(t) for t in out if t != own)
        if len(seen) >= threads - 1:
            break
    return tuple(sorted(seen)) if len(seen) == threads - 1 else ()


def _read(state, threads):
    """Read this thread's workers (ids and own affinities) for a pool of ``threads``; workers left narrowed by the
    last steer get their own affinities back first (a pool resized since keeps the workers it had)."""
    if state.pid != os.getpid():
        state.own, state.cpu = {}, -1  # a forked child: its parent's workers are not its own
    if state.cpu != -1:
        _set(state, state.masks)
    state.pid, state.threads, state.cpu = os.getpid(), threads, -1
    try:
        state.ids = _read_ids(threads)
        for tid in state.ids:
            if tid not in state.own:
                state.own[tid] = frozenset(os.sched_getaffinity(tid))
        state.masks = tuple(state.own[tid] for tid in state.ids)
    except (OSError, RuntimeError, NumbaError):  # not readable here (the region did not compile, a thread
        state.ids, state.masks = (), ()  # refused): steering off for this thread, never a failed kernel call
    state.clock_wall, state.others = time.perf_counter(), _others_cpu_s(state)  # the discovery's regions left out


def _alive(ids) -> bool:
    """Whether every id is still a thread of this process (GNU OpenMP ends a pool's surplus workers when a region
    asks for fewer threads, and starts new ones when a later region asks for more)."""
    return all(os.path.exists(f"/proc/self/task/{tid}") for tid in ids)


def worker_mask(own: set, cpu: int, n_workers: int) -> set:
    """The CPUs a worker whose own affinity is ``own`` may run on while the caller runs on ``cpu``: ``own`` less
    ``cpu``, or ``own`` itself where that leaves fewer CPUs than there are workers (or ``cpu`` is not in it)."""
    others = set(own) - {cpu}
    return others if len(others) >= n_workers else set(own)


def _set(state, masks) -> bool:
    """Set each worker's affinity; False when a worker is gone (the others still set; ids to read again) or may
    not be set (steering off for this thread)."""
    gone = False
    for tid, mask in zip(state.ids, masks):
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            gone = True
        except OSError:
            state.ids, state.masks = (), ()
            return False
    if gone:
        state.threads = 0
    return not gone


def _restore(state) -> None:
    """The workers' own affinities back where a steer narrowed them."""
    if state.cpu != -1 and _set(state, state.masks):
        state.cpu = -1


def thread_cpu_s(tid: int) -> float:
    """The CPU seconds thread ``tid`` of this process has used: its own CPU clock, ``clock_gettime`` of Linux's
    MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED) (include/linux/posix-timers.h), ~0.7-0.9 us, a system call. Raises
    OSError for a thread gone (OverflowError for an id out of range)."""
    return time.clock_gettime((~tid << 3) | 6)


def threads_cpu_s(tids) -> float:
    """The CPU seconds the threads ``tids`` of this process have used together (``thread_cpu_s``); a thread gone
    since, or an id out of range, counts nothing."""
    total = 0.0
    for tid in tids:
        try:
            total += thread_cpu_s(tid)
        except (OSError, OverflowError):
            pass
    return total


def _others_cpu_s(state) -> float:
    """CPU seconds of the process's threads other than this one and its workers (the workers' ``threads_cpu_s``
    taken from the process's clock; a worker gone since leaves its time in the process's: one busy answer)."""
    return time.process_time() - time.thread_time() - threads_cpu_s(state.ids)


def _others_busy(state, threads) -> bool:
    """Whether the workers should be left where the scheduler puts them for this region: the process's other
    threads (other pools'; not this thread, not its workers) used more than QUIET_SHARE of a core per worker since
    the clocks were last read. Within QUIET_GAP_S of the last call (the same kernel call's next region, or one
    right after it) the answer is the last one's, for up to ANSWER_AGE_S."""
    wall = time.perf_counter()
    gap, state.wall = wall - state.wall, wall
    if gap < QUIET_GAP_S and wall - state.clock_wall < ANSWER_AGE_S:
        return state.busy
    others = _others_cpu_s(state)
    state.busy = others - state.others > QUIET_SHARE * (threads - 1) * (wall - state.clock_wall)
    state.clock_wall, state.others = wall, others
    return state.busy


def steering() -> bool:
    """Whether ``steer_workers`` may narrow the affinity of this thread's workers (their ids read now if not yet);
    it does so while the process's other threads are quiet."""
    if not enabled():
        return False
    threads = _pool_size()
    state = _workers
    if threads >= 2 and (state.threads != threads or state.pid != os.getpid()):
        _read(state, threads)
    return threads >= 2 and bool(state.ids)


def steer_workers() -> None:
    """Keep Numba's workers off this thread's CPU for the region about to run while the process's other threads
    are quiet, or give them their own affinities back where those ran (see the module docstring): about 1.3 us for a
    call within QUIET_GAP_S of the last; after a longer gap, the CPU clocks (~0.9 us each, one per worker besides
    two) and, where the affinities change, one system call per worker."""
    if not SUPPORTED:
        return
    state = _workers
    if not ENABLED:
        _restore(state)
        return
    threads = _pool_size()
    if threads < 2:
        return
    if state.threads != threads:
        _read(state, threads)
    if _others_busy(state, threads):  # other threads ran since the last region: the scheduler places the workers
        _restore(state)
        return
    cpu = _sched_getcpu()
    if not state.ids or cpu == state.cpu or cpu < 0:
        return
    if state.pid != os.getpid() or not _alive(state.ids):  # forked since, or a pool resized since: other threads
        _read(state, threads)
        if not state.ids:
            return
    if _set(state, [worker_mask(own, cpu, len(state.ids)) for own in state.masks]):
        state.cpu = cpu


# -- cores held by the process's other threads (``threads.serial_if_small``) ---------------------------------------
def _read_proc(path, size) -> bytes | None:
    """The first ``size`` bytes of the /proc file ``path`` (one open and read, no Python file object: these are read
    before calls), or None where it cannot be read (a thread's file may go between the open and the read:
    ProcessLookupError)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _running(tid) -> bool:
    """Whether the thread ``tid`` of this process is running or waiting for a core: state R in the field after its
    name in /proc/self/task/<tid>/stat (proc(5)); False where it ended since (before the open or the read)."""
    stat = _read_proc(f"/proc/self/task/{tid}/stat", 512)
    if stat is None:
        return False
    end = stat.rfind(b")")  # the name, in parentheses, may hold any byte
    return end >= 0 and stat[end + 2:end + 3] == b"R"


def runnable_threads() -> int | None:
    """Threads running or waiting for a core on the whole machine at this moment, this one included: the fourth
    field of /proc/loadavg, "runnable/existing" (proc(5)); None where it cannot be read. One read, about 2 us,
    whatever the process's thread count: a bound on ``cores_held`` before its look at every thread."""
    fields = (_read_proc("/proc/loadavg", 256) or b"").split()
    try:
        return int(fields[3].split(b"/")[0])
    except (IndexError, ValueError):
        return None


def pool_cpu_count() -> int:
    """The CPUs this thread's pool may run on: the caller's and its workers' own affinities together (Linux), else
    ``os.cpu_count()``."""
    if not SUPPORTED:
        return os.cpu_count() or 1
    return len(set(os.sched_getaffinity(0)).union(*_workers.masks))


def cores_held() -> int | None:
    """How many of the process's other threads (not this one, not its workers) are running or waiting for a core at
    this moment (``_running``). A spinning pool's thread is, whether on a core of its own or queued behind this
    thread; a sleeping one is not. None where it cannot tell: not Linux, no pool, or the workers' ids unknown (a
    worker still leaving the last region would count). About 3 us a thread: the listing and one read each (2-vCPU
    Xeon, ``benchmarks/test_bench_threads.py``)."""
    if not SUPPORTED:
        return None
    state = _workers
    threads = _pool_size()
    if threads < 2:
        return None
    if state.threads != threads or state.pid != os.getpid() or not _alive(state.ids):  # as ``steer_workers``
        _read(state, threads)
    if not state.ids:
        return None
    try:
        names = os.listdir("/proc/self/task")
    except OSError:
        return None
    skip = {threading.get_native_id(), *state.ids}
    return sum(1 for name in names if int(name) not in skip and _running(name))
