"""An independent count of DRAM-side bytes: valgrind's cachegrind simulates a last-level cache of a chosen size
under the real CPU flash kernel (one thread), and its last-level misses × 64-byte lines, differenced between a run
with two kernel calls and one without (``cachegrind_probe.py``), are what the kernel brings from DRAM from a cold
cache — write misses included, since cachegrind's cache allocates on a write (write-backs are not counted, and the
outputs the model writes once are the lines those write misses bring in).

The cost model for the same schedule — the kernel's tiles, passed explicitly, one unit in flight (one thread), a
shared cache of the simulated size — must agree within 15% on the bytes read from DRAM: one configuration whose K
and V fit the cache (read once) and one whose K and V do not (re-read by every query block). The write misses
must cover the outputs the model writes (they also hold the first touches of freshly allocated buffers, which
vary with the allocator). The probe reads nothing of the output after its calls: a checksum of the output, read
once after the last call, added half its misses to each call's count (+17% at 1 MB per call).

Opt-in: valgrind runs the kernel about fifty times slower (some minutes of one core), so the test runs only with
IOAWARE_CACHEGRIND=1. Numba compiles for a fixed CPU (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``: AVX2, which
valgrind supports) into a cache directory of the test's own, outside valgrind first, so that the runs under
valgrind load the compiled kernel instead of compiling it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simulator import costs, hardware

ROOT = Path(__file__).resolve().parents[2]
LINE = 64  # cachegrind's --LL line size below
TOLERANCE = 0.15
FEATURES = ("+64bit,+aes,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+lzcnt,+mmx,+movbe,+pclmul,"
            "+popcnt,+rdrnd,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
# (N, d, H, Br, Bc, last-level bytes): K and V of a head fit (2·512·64·4 B in 2 MiB, the 4 MiB of all heads do
# not), or do not (1024 rows, 256 KiB). Megabytes per call, so that the allocator's noise in the difference of two
# whole-process runs (~0.1 MB) stays small beside it
CASES = [(512, 64, 8, 64, 64, 2 << 20), (1024, 64, 2, 64, 64, 256 << 10)]

pytestmark = pytest.mark.skipif(
    os.environ.get("IOAWARE_CACHEGRIND") != "1" or shutil.which("valgrind") is None,
    reason="opt-in (IOAWARE_CACHEGRIND=1, valgrind on the PATH): cachegrind runs the kernel ~50x slower")


def _env(cache_dir):
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", "NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": FEATURES, "NUMBA_CACHE_DIR": str(cache_dir), "NUMBA_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _ll_misses(case, calls, env, tmp_path):
    n, d, h, br, bc, ll = case
    args = [sys.executable, "-m", "tests.simulator.cachegrind_probe", *map(str, (n, d, h, br, bc, calls, ll))]
    run = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={ll},16,{LINE}",
                          f"--cachegrind-out-file={tmp_path / f'cg.{calls}'}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"LLd misses:\s+([\d,]+)\s+\(\s*([\d,]+) rd\s+\+\s+([\d,]+) wr", run.stderr)
    return tuple(int(x.replace(",", "")) for x in found.groups())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-H{c[2]}-LL{c[5] >> 10}KiB")
def test_cachegrind_counts_what_the_cost_model_predicts(case, tmp_path):
    n, d, h, br, bc, ll = case
    env = _env(tmp_path / "numba")
    args = [sys.executable, "-m", "tests.simulator.cachegrind_probe", *map(str, (n, d, h, br, bc, 2, ll))]
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)  # compile, natively
    with_calls, without = _ll_misses(case, 2, env, tmp_path), _ll_misses(case, 0, env, tmp_path)
    measured = [(a - b) * LINE / 2 for a, b in zip(with_calls, without)]  # bytes per call: all, read, write
    one_thread = hardware.replace(hardware.load("H100-SXM"), name="cachegrind", kind="cpu", sm_count=1,
                                  l2_bytes=ll, compute_capability="")
    cost = costs.flash2_forward(1, h, h, n, n, d, elem_bytes=4, Br=br, Bc=bc, hw=one_thread)
    print(f"cachegrind bytes per call: {measured[0]:.0f} ({measured[1]:.0f} read, {measured[2]:.0f} write misses); "
          f"cost model DRAM bytes {float(cost.dram_bytes):.0f} ({float(cost.dram_read_bytes):.0f} read, "
          f"{float(cost.dram_write_bytes):.0f} written)")
    assert measured[1] == pytest.approx(float(cost.dram_read_bytes), rel=TOLERANCE)
    # a write miss allocates a line: the outputs' lines are among them, and so are the first touches of the
    # buffers the call allocates (its output, lse, the tasks' tiles), which the model does not count as traffic
    assert measured[2] >= (1 - TOLERANCE) * float(cost.dram_write_bytes)
