"""Fake parts for tests/simulator/test_gpu_check.py: cases that pass, raise, kill their process, hang, or need a
package that is not installed, run by the GPU check's real runner and worker without a GPU."""
from __future__ import annotations

import os
import time

from simulator.gpu_check._rows import Case

COLUMNS = ["name", "value"]


def _raise():
    raise ValueError("planted failure")


def _crash():
    os._exit(7)  # as a segfault or a sticky CUDA error would end the process: no row, no exception


def _hang():
    time.sleep(600)


def cases(quick: bool) -> list[Case]:
    def case(name, run, **kw):
        return Case(name=name, size="n=1", run=run, estimate_s=0.1, columns={"name": name}, **kw)

    return [case("ok", lambda: {"value": 1, "status": "passed"}),
            case("raises", _raise),
            case("crashes", _crash),
            case("hangs", _hang, limit_s=2.0),
            case("needs-missing", lambda: {"value": 2}, needs=("no_such_package_for_ioaware_tests",)),
            case("after", lambda: {"value": 3})]


def slow_cases(quick: bool) -> list[Case]:
    return [Case(name=f"slow{i}", size="n=1", run=lambda: time.sleep(1.5) or {"value": 0}, estimate_s=1.5,
                 columns={"name": f"slow{i}"}) for i in range(4)]
