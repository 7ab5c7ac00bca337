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
import os, pathlib, sys, types
os.environ["PYTEST_XDIST_WORKER"] = "gw0"
from tests.helpers import session_lock
factory = types.SimpleNamespace(getbasetemp=lambda: pathlib.Path(sys.argv[1]) / "basetemp")
with session_lock(factory, alone=sys.argv[2] == "alone"):
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
