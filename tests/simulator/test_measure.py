"""simulator.measure.time_call: the pause, the warm-up and the timed calls."""
from __future__ import annotations

import math
import threading
import time

import pytest

from simulator import measure
from simulator.measure import WARM_S, time_call


class _Counter:
    def __init__(self, seconds=0.0):
        self.calls, self.seconds = 0, seconds

    def __call__(self):
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)


class _Clock:
    """A stand-in for ``time`` in simulator.measure whose clock moves only when something sleeps: counts of calls
    exact, whatever the machine's load (a real 5 ms sleep took over 10 ms in a loaded CI run). Steps of 2^-8 s, so
    that the sums are exact in binary."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def process_time(self):  # the process's CPU clock: idle
        return 0.0

    def sleep(self, seconds):
        self.now += seconds


class _SpinningClock(_Clock):
    """The same, in a process where another pool's worker spins on one core until ``spins_until``: the process's CPU
    clock moves as the wall clock does until then, not after."""

    def __init__(self, spins_until):
        super().__init__()
        self.spins_until, self.cpu = spins_until, 0.0

    def process_time(self):
        return self.cpu

    def sleep(self, seconds):
        self.cpu += max(0.0, min(self.now + seconds, self.spins_until) - self.now)
        self.now += seconds


@pytest.mark.parametrize("warm_steps", [4, 10])
def test_after_a_pause_the_calls_warm_up_for_warm_s(monkeypatch, warm_steps):
    step = 2.0**-8  # the seconds one call takes
    clock = _Clock()
    monkeypatch.setattr(measure, "time", clock)
    fn = _Counter()
    fn_calls = []

    def call():
        fn()
        fn_calls.append(clock.now)
        clock.sleep(step)

    t = time_call(call, repeats=3, warmup=1, settle_s=2 * step, warm_s=warm_steps * step)
    # the pause, then calls until warm_s has passed since the warm-up began (the one warm-up call included), then
    # the three timed ones
    assert fn_calls[0] == 2 * step
    assert fn.calls == warm_steps + 3
    assert t.repeats == 3 and t.samples_s == (step, step, step)


@pytest.mark.parametrize("spinning_steps", [0, 1, 7, 10.5])
def test_settle_idles_until_the_process_is_quiet(monkeypatch, spinning_steps):
    step = measure.QUIET_STEP_S
    clock = _SpinningClock(spins_until=spinning_steps * step)
    monkeypatch.setattr(measure, "time", clock)
    # every step in which the worker spun (here at least half of the last one: over QUIET_SHARE), then the quiet ones
    idled = (math.ceil(spinning_steps) + measure.QUIET_STEPS) * step
    assert measure.settle(max_s=100 * step) == pytest.approx(idled)
    assert clock.now == pytest.approx(idled)


def test_settle_needs_quiet_steps_in_a_row(monkeypatch):
    step = measure.QUIET_STEP_S
    clock = _SpinningClock(spins_until=0.0)
    busy_steps = {0, 2, 4}  # a worker that spins in every other step (kept off the cores in the others)

    def sleep(seconds):
        if round(clock.now / step) in busy_steps:
            clock.cpu += seconds
        clock.now += seconds

    clock.sleep = sleep
    monkeypatch.setattr(measure, "time", clock)
    assert measure.settle(max_s=100 * step) == pytest.approx((max(busy_steps) + 1 + measure.QUIET_STEPS) * step)


@pytest.mark.alone  # it needs a core for the spinning thread: under pytest-xdist, no other test meanwhile
def test_settle_sees_another_thread_spin():
    # the real clocks: another thread of this process that spins keeps settle waiting (a clock of this thread only,
    # time.thread_time, would not see it), and it returns soon after the thread stops
    spin_s = 0.2
    stop = threading.Event()

    def spin():
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end and not stop.is_set():
            pass

    thread = threading.Thread(target=spin)
    start = time.perf_counter()
    thread.start()
    try:
        idled = measure.settle(max_s=1.0)
    finally:
        stop.set()
        thread.join()
    assert spin_s / 2 <= idled <= time.perf_counter() - start
    assert measure.settle(max_s=1.0) < 0.5  # quiet now: QUIET_STEPS steps, however loaded the machine


@pytest.mark.parametrize("max_s", [0.0, 0.001, 0.035])
def test_settle_idles_at_most_max_s(monkeypatch, max_s):
    clock = _SpinningClock(spins_until=1e9)  # a pool that never sleeps
    monkeypatch.setattr(measure, "time", clock)
    assert measure.settle(max_s=max_s) == pytest.approx(max_s)


def test_time_call_pauses_until_quiet(monkeypatch):
    step = measure.QUIET_STEP_S
    clock = _SpinningClock(spins_until=4 * step)
    monkeypatch.setattr(measure, "time", clock)
    first = []
    time_call(lambda: first.append(clock.now) if not first else None, repeats=1, warmup=1, warm_s=0.0)
    # not SETTLE_S: the spinning pool went quiet after four steps
    assert first == [pytest.approx((4 + measure.QUIET_STEPS) * step)]


def test_the_default_warm_up_follows_the_pause():
    without = _Counter()
    time_call(without, repeats=2, warmup=1, settle_s=0.0)
    assert without.calls == 3  # no pause, nothing to warm up again: the warm-up calls only
    paused = _Counter(0.001)
    start = time.perf_counter()
    time_call(paused, repeats=2, warmup=1, settle_s=0.001)
    assert time.perf_counter() - start >= WARM_S


def test_in_turn_calls_each_in_order_round_robin():
    from simulator.measure import in_turn

    order = []
    call = in_turn([lambda i=i: order.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert order == [0, 1, 2, 0, 1, 2, 0]


def test_streamed_gemv_times_both_kinds_and_checks_its_buffer():
    import numpy as np

    from simulator.measure import streamed_gemv_seconds

    k = 64
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    buffer = np.ones(8 * k * k, dtype=np.float32)  # 8 float32 layers, 32 int8 ones
    t_fp32, t_int8 = streamed_gemv_seconds(buffer, k, x, repeats=3)
    assert t_fp32 > 0 and t_int8 > 0
    for bad in (np.ones(k * k, dtype=np.float32), np.ones(8 * k * k, dtype=np.float64)):
        with pytest.raises(ValueError, match="room for two"):
            streamed_gemv_seconds(bad, k, x)
