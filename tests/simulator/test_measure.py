"""simulator.measure.time_call: the pause, the warm-up and the timed calls."""
from __future__ import annotations

import time

import pytest

from simulator.measure import WARM_S, time_call


class _Counter:
    def __init__(self, seconds=0.0):
        self.calls, self.seconds = 0, seconds

    def __call__(self):
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)


@pytest.mark.parametrize("warm_s", [0.02, 0.05])
def test_after_a_pause_the_calls_warm_up_for_warm_s(warm_s):
    fn = _Counter(0.005)
    start = time.perf_counter()
    t = time_call(fn, repeats=3, warmup=1, settle_s=0.01, warm_s=warm_s)
    assert time.perf_counter() - start >= 0.01 + warm_s
    assert fn.calls >= 3 + 1 + int(warm_s / 0.005 * 0.5)  # the warm-up went on past its one call
    assert t.repeats == 3 and t.min_s <= t.median_s


def test_the_default_warm_up_follows_the_pause():
    without = _Counter()
    time_call(without, repeats=2, warmup=1, settle_s=0.0)
    assert without.calls == 3  # no pause, nothing to warm up again: the warm-up calls only
    paused = _Counter(0.001)
    start = time.perf_counter()
    time_call(paused, repeats=2, warmup=1, settle_s=0.001)
    assert time.perf_counter() - start >= WARM_S
