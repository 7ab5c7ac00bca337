"""kernels._common.affinity: Numba's workers kept off the calling thread's CPU before a parallel region that
follows a quiet pause, left to the scheduler after other threads ran, and the launchers that steer them."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit

from kernels._common import affinity, blas, threads

from tests.helpers import numba_threads

needs_steering = pytest.mark.skipif(not affinity.SUPPORTED or len(os.sched_getaffinity(0)) < 2
                                    or numba.config.NUMBA_NUM_THREADS < 2,
                                    reason="needs Linux with gettid (glibc >= 2.30), two CPUs and a pool of two")


SETTLE_S = 0.3  # other pools' threads of this process (NumPy's OpenBLAS spins ~0.1 s after a call) at rest first
PAUSE_S = 0.05  # past QUIET_GAP_S


def _steer_after_a_quiet_pause():
    """steer_workers after a pause in which no other thread of the process ran: the workers narrowed."""
    time.sleep(SETTLE_S)
    affinity.steer_workers()  # the clocks read
    time.sleep(PAUSE_S)
    affinity.steer_workers()


@pytest.fixture
def pool_of_two(monkeypatch):
    monkeypatch.setattr(affinity, "ENABLED", True)
    with numba_threads(2):
        affinity._workers.cpu = -1  # set the masks again at the next steer
        yield
    state = affinity._workers
    for tid in state.ids:  # the workers back on every CPU of the process, and the state read afresh
        try:
            os.sched_setaffinity(tid, os.sched_getaffinity(0))
        except ProcessLookupError:  # (a test's made-up id)
            pass
    state.__init__()


@pytest.mark.parametrize("own, cpu, n_workers, mask", [
    ({0, 1}, 0, 1, {1}), ({0, 1, 2, 3}, 2, 3, {0, 1, 3}),  # the caller's CPU left out
    ({0, 1}, 1, 3, {0, 1}),  # more workers than the other CPUs: their own
    ({5}, 5, 1, {5}), ({1}, 0, 1, {1}), ({0, 2, 4}, 7, 2, {0, 2, 4}),  # nothing to leave out: their own
])
def test_a_workers_mask_leaves_out_the_callers_cpu_where_the_others_suffice(own, cpu, n_workers, mask):
    assert affinity.worker_mask(own, cpu, n_workers) == mask


@needs_steering
def test_the_worker_ids_are_the_pools_other_threads(pool_of_two):
    ids = affinity._read_ids(2)
    tasks = {int(t) for t in os.listdir("/proc/self/task")}
    assert len(ids) == 1 and ids[0] != threading.get_native_id() and ids[0] in tasks


@needs_steering
def test_steering_takes_the_callers_cpu_out_of_each_workers_affinity(pool_of_two):
    _steer_after_a_quiet_pause()
    state = affinity._workers
    assert state.ids and state.cpu in os.sched_getaffinity(0)
    for tid, own in zip(state.ids, state.masks):
        assert os.sched_getaffinity(tid) == own - {state.cpu}


@needs_steering
def test_turning_steering_off_gives_the_workers_their_own_affinity_back(pool_of_two, monkeypatch):
    _steer_after_a_quiet_pause()
    state = affinity._workers
    assert [os.sched_getaffinity(tid) for tid in state.ids] == [own - {state.cpu} for own in state.masks]
    monkeypatch.setattr(affinity, "ENABLED", False)
    _steer_after_a_quiet_pause()
    assert not affinity.enabled() and not affinity.steering()
    assert [os.sched_getaffinity(tid) for tid in state.ids] == list(state.masks)


@needs_steering
def test_a_worker_bound_to_one_cpu_keeps_it(pool_of_two):
    """A worker whose own affinity is one CPU (as OMP_PROC_BIND binds it) is never moved, whichever CPU the caller
    runs on."""
    assert affinity.steering()
    state = affinity._workers
    bound = {min(os.sched_getaffinity(0))}
    os.sched_setaffinity(state.ids[0], bound)
    state.threads, state.own = 0, {}  # read the ids and their affinities afresh, as first seen
    for _ in range(3):
        state.cpu = -1
        _steer_after_a_quiet_pause()
        assert os.sched_getaffinity(state.ids[0]) == bound


@needs_steering
def test_ids_of_workers_gone_are_read_again(pool_of_two, monkeypatch):
    monkeypatch.setattr(affinity, "_others_busy", lambda state, threads: False)  # (a made-up id has no CPU clock)
    assert affinity.steering()
    state = affinity._workers
    real = state.ids
    state.ids, state.masks, state.cpu = (2**31 - 1,), (frozenset({0}),), -1  # no such thread
    _steer_after_a_quiet_pause()
    assert state.ids == real


@needs_steering
def test_after_other_threads_ran_the_workers_are_left_to_the_scheduler(pool_of_two):
    """Another thread busy through the pause (as another pool's spinning threads are): the workers get their own
    affinities back, so that they may run wherever a core frees first."""
    _steer_after_a_quiet_pause()
    state = affinity._workers
    assert state.cpu != -1
    stop = time.perf_counter() + 2 * PAUSE_S

    def spin():
        while time.perf_counter() < stop:
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    spinner.join()
    affinity.steer_workers()
    assert state.busy and state.cpu == -1
    assert [os.sched_getaffinity(tid) for tid in state.ids] == list(state.masks)


class _Clocks:
    """Made-up clocks for ``_others_busy``: wall time, and the CPU seconds of the other threads, of this thread and
    of the workers (the process's time is their sum)."""

    def __init__(self):
        self.wall, self.others, self.caller, self.workers = 100.0, 0.0, 0.0, 0.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.others + self.caller + self.workers

    def thread_time(self):
        return self.caller

    def clock_gettime(self, clock):
        return self.workers

    def step(self, seconds, others=0.0, caller=0.0, workers=0.0):
        self.wall += seconds
        self.others += others * seconds
        self.caller += caller * seconds
        self.workers += workers * seconds


@pytest.fixture
def clocks(monkeypatch):
    made_up = _Clocks()
    monkeypatch.setattr(affinity, "time", made_up)
    state = affinity._Workers()
    state.ids = (1,)  # one worker (its clock is made up too)
    state.clock_wall, state.others = made_up.wall, 0.0
    state.wall = made_up.wall
    return made_up, state


def test_the_rule_calls_a_pause_quiet_whatever_the_caller_and_its_workers_did(clocks):
    made_up, state = clocks
    made_up.step(0.010, caller=1.0, workers=1.0)  # a region of 10 ms: the caller and its worker busy
    made_up.step(0.005)  # then a pause of 5 ms, shorter than the region
    assert not affinity._others_busy(state, 2)


def test_the_rule_calls_other_threads_busy(clocks):
    made_up, state = clocks
    made_up.step(0.050, others=1.0)  # another pool's thread spinning through a pause
    assert affinity._others_busy(state, 2)
    made_up.step(0.050, others=0.1)  # a tenth of a core: quiet
    assert not affinity._others_busy(state, 2)


def test_within_the_gap_the_last_answer_holds_for_a_while(clocks):
    made_up, state = clocks
    made_up.step(0.050)
    assert not affinity._others_busy(state, 2)
    read_at = state.clock_wall
    made_up.step(affinity.QUIET_GAP_S / 2, others=1.0)  # the same call's next region: the clocks not read
    assert not affinity._others_busy(state, 2) and state.clock_wall == read_at
    for _ in range(int(affinity.ANSWER_AGE_S / (affinity.QUIET_GAP_S / 2)) + 1):  # a string of close calls
        made_up.step(affinity.QUIET_GAP_S / 2, others=1.0)
        busy = affinity._others_busy(state, 2)
    assert busy and state.clock_wall > read_at  # read again once the answer is ANSWER_AGE_S old


def test_the_launchers_steer_before_their_regions(rng, monkeypatch):
    """batched_matmul (through single_threaded_blas) and a call that serial_if_small leaves on the pool steer; a
    small call, which runs on the calling thread, does not."""
    calls = []
    monkeypatch.setattr(affinity, "cores_held", lambda: 0)  # no other pool's thread spinning: the pool runs
    monkeypatch.setattr(blas, "steer_workers", lambda: calls.append("blas"))
    monkeypatch.setattr(affinity, "steer_workers", lambda: calls.append("pool"))
    a = rng.standard_normal((1, 8, 4), dtype=np.float32)
    blas.batched_matmul(a, a, transpose_b=True)
    with threads.serial_if_small(multiply_adds=threads.SERIAL_MULTIPLY_ADDS):
        pass
    with threads.serial_if_small(multiply_adds=1):
        pass
    assert calls == ["blas", "pool"]


@needs_steering
def test_a_worker_read_again_after_a_steer_keeps_its_own_affinity(pool_of_two):
    """Ids read again (a pool resized) find the workers narrowed; their own affinities stay the ones first read, so
    that a caller that moves to another CPU is left out of the worker's whole own set, not of the narrowed one."""
    _steer_after_a_quiet_pause()
    state = affinity._workers
    own = state.masks
    assert [os.sched_getaffinity(tid) for tid in state.ids] == [m - {state.cpu} for m in own]
    state.threads = 0
    _steer_after_a_quiet_pause()
    assert state.masks == own
    for cpu in sorted(os.sched_getaffinity(0)):  # as if the caller had moved to each CPU in turn
        assert affinity._set(state, [affinity.worker_mask(m, cpu, len(state.ids)) for m in state.masks])
        assert [os.sched_getaffinity(tid) for tid in state.ids] == [m - {cpu} for m in own]


@needs_steering
def test_ids_read_in_another_process_are_read_again(pool_of_two, monkeypatch):
    """Ids from before a fork name the parent's threads: another pid's are never used."""
    monkeypatch.setattr(affinity, "_others_busy", lambda state, threads: False)  # (a made-up id has no CPU clock)
    _steer_after_a_quiet_pause()
    real = affinity._workers.ids
    affinity._workers.pid, affinity._workers.ids, affinity._workers.cpu = -1, (2**31 - 1,), -1
    _steer_after_a_quiet_pause()
    assert affinity._workers.ids == real and affinity._workers.pid == os.getpid()


# -- cores held by other threads ------------------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def _spin(n):
    """A loop of ``n`` dependent steps without the GIL: a thread that holds its core, as a spinning pool's does."""
    x = 0.5
    for _ in range(n):
        x = x * 0.999 + 0.001
    return x


LOOKS = 10  # looks 10 ms apart: a thread that another process kept off the cores at one look is seen at another


def _asleep(tid):
    """Wait (at most a second) until the thread ``tid`` is no longer running: on its way into a sleep it may be."""
    for _ in range(100):
        if not affinity._running(tid):
            return
        time.sleep(0.01)


@needs_steering
@pytest.mark.alone
def test_a_running_thread_holds_a_core_and_a_sleeping_one_does_not(pool_of_two):
    time.sleep(SETTLE_S)
    _spin(10)  # compiled
    sleeper = threading.Thread(target=time.sleep, args=(1.0,))
    sleeper.start()
    _asleep(sleeper.native_id)
    assert affinity.cores_held() == 0  # the sleeper, NumPy's pool at rest, the workers between regions
    started = threading.Event()

    def spin():
        started.set()
        _spin(2 * 10**8)  # ~0.2-0.3 s: past the looks

    spinner = threading.Thread(target=spin)
    spinner.start()
    started.wait()
    try:
        seen, runnable = [], []
        for _ in range(LOOKS):
            time.sleep(0.01)
            seen.append(affinity.cores_held())
            runnable.append(affinity.runnable_threads())
        assert max(seen) == 1
        assert max(runnable) >= 2  # the machine's count: the spinner and this thread at least
    finally:
        spinner.join()
        sleeper.join()


@needs_steering
def test_the_caller_and_its_workers_are_not_held_cores(pool_of_two, monkeypatch):
    """Every thread made up to be running: the process's other threads count, the caller and its workers (a worker
    may still be leaving the last region) do not."""
    affinity.steering()  # the workers' ids read
    state = affinity._workers
    sleeper = threading.Thread(target=time.sleep, args=(0.2,))  # another thread of the process, whatever else runs
    sleeper.start()
    looked = []
    monkeypatch.setattr(affinity, "_running", lambda tid: looked.append(int(tid)) or True)
    held = affinity.cores_held()
    sleeper.join()
    assert state.ids and held == len(looked) and sleeper.native_id in looked
    assert not set(looked) & {threading.get_native_id(), *state.ids}


@needs_steering
def test_the_pool_cpus_are_the_callers_and_the_workers(pool_of_two):
    affinity.steering()
    assert affinity.pool_cpu_count() == len(set(os.sched_getaffinity(0)).union(*affinity._workers.masks)) >= 2


@pytest.mark.skipif(not affinity.SUPPORTED, reason="reads Linux's /proc/loadavg")
def test_the_machine_counts_this_thread_runnable():
    assert affinity.runnable_threads() >= 1


def test_an_unreadable_count_of_runnable_threads_is_none(monkeypatch):
    def refuse(*args):
        raise FileNotFoundError("/proc/loadavg")

    monkeypatch.setattr(affinity.os, "open", refuse)
    assert affinity.runnable_threads() is None


@pytest.mark.skipif(not affinity.SUPPORTED, reason="reads Linux's /proc/self/task")
def test_a_threads_state_is_read_after_its_name():
    """A name with a parenthesis and an R in it (any byte may be in a thread's name) does not make a sleeping thread
    running."""
    sleeper = threading.Thread(target=time.sleep, args=(0.5,))
    sleeper.start()
    task = Path(f"/proc/self/task/{sleeper.native_id}")
    (task / "comm").write_text("x) R (y")
    _asleep(sleeper.native_id)
    assert ") R (" in (task / "stat").read_text()
    assert not affinity._running(sleeper.native_id)
    assert affinity._running(threading.get_native_id())  # this thread, reading its own state
    sleeper.join()
    assert not affinity._running(0)  # no such thread of this process (one that ended may linger a moment, exiting)
