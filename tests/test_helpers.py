"""The helpers that no other test exercises: the bfloat16 rounding of the CuPy tests and the GPU check
(``kernels.attn.round_to``), and the lock that runs a test alone under pytest-xdist (``tests.helpers.session_lock``)."""
from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np

from kernels.attn import round_to

ROOT = Path(__file__).resolve().parents[1]


def round_to_bfloat16(x):
    return round_to(x, "bfloat16")


def test_round_to_bfloat16_keeps_8_significant_bits_ties_to_even(rng):
    ulp = 2.0**-7  # bfloat16 spacing in [1, 2): 7 fraction bits
    x = np.array([1.0, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -3.0, np.inf, -np.inf, 0.0],
                 dtype=np.float32)
    assert round_to_bfloat16(x).tolist() == [1.0, 1.0, 1 + 2 * ulp, 1 + ulp, -3.0, np.inf, -np.inf, 0.0]
    assert np.isnan(round_to_bfloat16(np.array([np.nan], np.float32)))[0]
    v = rng.standard_normal(10**4).astype(np.float32)
    r = round_to_bfloat16(v)
    assert np.all(np.abs(r - v) <= 2.0**-8 * np.abs(v))  # half an ulp, relative
    assert np.all(r.view(np.uint32) & 0xFFFF == 0)  # only the top 16 bits remain


# ``session_lock`` held by a process of its own, as an xdist worker holds it: "held" once it has the lock, and it
# lets go at a line on its standard input
_HOLDER = """
import sys
from tests.helpers import session_lock
with session_lock(sys.argv[1], alone=sys.argv[2] == "alone"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _holder(tmp_path, mode):
    return subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _holds(process, timeout):
    """Whether ``process`` says it holds the lock within ``timeout`` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    return bool(ready) and process.stdout.readline().strip() == "held"


def _let_go(process):
    process.stdin.write("\n")
    process.stdin.flush()
    assert process.wait(timeout=60) == 0


def test_a_test_that_runs_alone_waits_for_the_others_and_holds_back_new_ones(tmp_path):
    together = _holder(tmp_path, "together")
    assert _holds(together, 60)
    second = _holder(tmp_path, "together")
    assert _holds(second, 60)  # shared: two ordinary tests side by side
    alone = _holder(tmp_path, "alone")
    assert not _holds(alone, 2.0)  # it waits for both
    _let_go(together)
    assert not _holds(alone, 0.5)
    late = _holder(tmp_path, "together")  # started while the alone one waits: held back by the gate
    assert not _holds(late, 2.0)
    _let_go(second)
    assert _holds(alone, 60)
    assert not _holds(late, 1.0)
    _let_go(alone)
    assert _holds(late, 60)
    _let_go(late)


_LOGGED = '''
import time
import pytest

def log(name, start):
    with open({log!r}, "a") as f:
        f.write(f"{{name}} {{start}} {{time.monotonic()}}\\n")
'''


def test_under_xdist_no_other_test_or_fixture_runs_beside_an_alone_test(tmp_path):
    # this conftest's hooks in a session of two workers: a module fixture and a test of one file, an alone test of
    # another, each logging when it ran; nothing may overlap the alone test
    log = tmp_path / "log.txt"
    (tmp_path / "conftest.py").write_text("from tests.conftest import (pytest_configure, pytest_configure_node, "
                                          "pytest_runtest_protocol, pytest_unconfigure)\n")
    (tmp_path / "test_together.py").write_text(_LOGGED.format(log=str(log)) + '''
@pytest.fixture(scope="module")
def slow_setup():
    start = time.monotonic()
    time.sleep(1.0)
    log("fixture", start)

@pytest.mark.parametrize("i", range(3))
def test_together(slow_setup, i):
    start = time.monotonic()
    time.sleep(0.3)
    log("together", start)
''')
    (tmp_path / "test_alone.py").write_text(_LOGGED.format(log=str(log)) + '''
@pytest.mark.parametrize("i", range(2))
@pytest.mark.alone
def test_alone(i):
    start = time.monotonic()
    time.sleep(0.5)
    log("alone", start)
''')
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadfile", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
                              "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    spans = [(name, float(a), float(b)) for name, a, b in (line.split() for line in log.read_text().splitlines())]
    assert sorted(name for name, _, _ in spans) == ["alone", "alone", "fixture", "together", "together", "together"]
    for name, a, b in spans:
        if name == "alone":
            assert not [other for other in spans if other[0] != "alone" and other[1] < b and a < other[2]], spans


def test_numpys_row_stack_alias_is_restored_where_numpy_dropped_it(monkeypatch):
    """numba-cuda 0.30's CUDA typing overloads np.row_stack, which NumPy 2.5 removed (kernels/_common/gpu.py)."""
    from kernels._common import gpu

    monkeypatch.delattr(np, "row_stack", raising=False)
    gpu.restore_numpy_aliases()
    assert np.row_stack is np.vstack
    kept = np.row_stack
    gpu.restore_numpy_aliases()  # where the name exists it is left alone
    assert np.row_stack is kept
