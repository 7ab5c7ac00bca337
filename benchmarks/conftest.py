"""Benchmark fixtures: this machine's peaks measured in the same run, and a summary table printed at the end.

Run: ``python -m pytest benchmarks/ --benchmark-only`` (not part of the default test run). Where the environment
sets ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` (they slow a current NumPy's BLAS), run with both unset for that
command alone: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest benchmarks/ --benchmark-only``;
the summary prints which BLAS kernel then ran.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import kernels
from kernels.cpuinfo import cpu_model
from simulator.calibrate import dram_test_bytes, read_bandwidth
from simulator.measure import settle as settle_pools, time_call


SGEMM_N = 2048  # large enough that sgemm runs near peak on every core


def pytest_configure(config):
    config._ioaware_rows = []


@pytest.fixture(scope="session")
def machine_peaks():
    """sgemm GFLOP/s (2·n³ / t), copy GB/s (2·bytes / t: each byte read once and written once) and read GB/s
    (bytes / t, all cores, nothing written: ``simulator.calibrate.read_bandwidth``), measured now."""
    read_gbps = read_bandwidth() / 1e9  # first: NumPy's BLAS threads spin for ~0.1 s after the sgemm below
    copy_bytes = dram_test_bytes()  # twice the largest cache: from DRAM, not from the cache
    src = np.ones(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy = time_call(lambda: np.copyto(dst, src), repeats=5, warmup=1)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32) for _ in range(2))
    sgemm = time_call(lambda: a @ b, repeats=5, warmup=2)
    peaks = {"sgemm_gflops": 2 * SGEMM_N**3 / sgemm.median_s / 1e9,
             "copy_gbps": 2 * copy_bytes / copy.median_s / 1e9, "read_gbps": read_gbps}
    _MEASURED.update(peaks)
    return peaks


_MEASURED: dict = {}  # the peaks, once measured, for the summary's machine line


@pytest.fixture(autouse=True)
def settle():
    """Let the previous benchmark's thread pools stop spinning (``simulator.measure.settle``)."""
    settle_pools()


@pytest.fixture
def record(request):
    """Add a row (a dict) to the summary table printed after the run."""
    return request.config._ioaware_rows.append


def pytest_terminal_summary(terminalreporter, config):
    rows = getattr(config, "_ioaware_rows", [])
    if not rows:
        return
    from threadpoolctl import threadpool_info

    tr = terminalreporter
    tr.section("ioaware figures")
    blas = {(i.get("internal_api"), i.get("architecture")) for i in threadpool_info() if i["user_api"] == "blas"}
    pool = kernels.pool_info()
    peaks = ", ".join(f"{key}={value:.1f}" for key, value in _MEASURED.items()) or "not measured in this run"
    tr.write_line(f"machine: {cpu_model()}, {os.cpu_count()} logical cores; ioaware pool: "
                  f"{pool['threading_layer']} x{pool['threads']} threads, wait policy {pool['wait_policy']}, "
                  f"workers off the caller's CPU: {pool['steer_workers']}; "
                  f"BLAS: {sorted(blas)}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    tr.write_line(f"peaks measured in this run: {peaks}")
    for row in rows:
        tr.write_line("  ".join(f"{key}={value}" for key, value in row.items()))
