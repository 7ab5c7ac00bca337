"""Helpers the benchmarks share: percentiles, rates held to a read taken beside them, and timing peers in fresh
processes."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

PEER_PROBE = Path(__file__).with_name("peer_probe.py")


def p90(samples):
    """The nearest-rank 90th percentile (of 30 samples: the 27th smallest)."""
    ordered = sorted(samples)
    return ordered[int(0.9 * (len(ordered) - 1))]


def beside_reads(run, read_buffer, rounds, also=None):
    """``rounds`` of ``run()`` (a rate), each followed by the all-core read bandwidth (bytes/s) of ``read_buffer``
    (``simulator.calibrate.read_bandwidth_of``) and, with ``also``, by ``also()``: the three lists. A VM's memory
    speed moves within minutes, so each rate is held to the read of its own moment."""
    from simulator.calibrate import read_bandwidth_of

    rates, reads, others = [], [], []
    for _ in range(rounds):
        rates.append(run())
        reads.append(read_bandwidth_of(read_buffer))
        if also is not None:
            others.append(also())
    return rates, reads, others


def alternate_in_fresh_processes(workloads, *, pairs=3, repeats=5):
    """Median seconds of each workload, each timed in ``pairs`` fresh processes taken in turn (A B A B ...), so
    that no thread pool of one peer taxes the other and slow drifts of the machine hit both alike.

    ``workloads``: name -> argument list of ``peer_probe.py``. Returns name -> (median_s, all samples, check).
    """
    samples = {name: [] for name in workloads}
    checks = {}
    for _ in range(pairs):
        for name, args in workloads.items():
            done = subprocess.run([sys.executable, str(PEER_PROBE), *args, "--repeats", str(repeats)],
                                  check=True, capture_output=True, text=True, timeout=600,
                                  cwd=PEER_PROBE.parent.parent)
            result = json.loads(done.stdout)
            samples[name] += result["samples_s"]
            checks[name] = result["check"]
    return {name: (statistics.median(xs), xs, checks[name]) for name, xs in samples.items()}
