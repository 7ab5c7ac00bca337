"""The worker process of the GPU check: ``python -m simulator.gpu_check.worker MODULE:FUNCTION --csv PATH
--start N --inflight PATH --deadline T [--quick]`` runs cases N, N+1, ... of a part, one row each, appended to the
CSV at once. Before each case it writes "<id> <start time>" to the in-flight file, so the runner knows which case
a crash or a timeout interrupted. After a case that raised, it checks that the CUDA context still works; if not,
it exits with ``STICKY_EXIT`` and the runner starts a fresh process for the next case.
"""
from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import time
from pathlib import Path

from ._rows import RowLog, run_case
from ._runner import STICKY_EXIT, load_part


def available(name: str) -> bool:
    """Whether a case's need is met here: a GPU package that sees a device, or an importable package."""
    if name in ("cupy", "numba-cuda"):
        from kernels._common import gpu as _gpu

        if name == "cupy":
            return _gpu.cupy_module() is not None
        return _gpu.numba_cuda() is not None and not _gpu.simulated()
    return importlib.util.find_spec(name) is not None


def context_usable() -> bool:
    """False when the process's CUDA context is broken (a sticky error); True when no GPU package is in use."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return True
    try:
        cupy.cuda.Device().synchronize()
        cupy.cuda.runtime.getLastError()
        return True
    except Exception:  # cudaErrorIllegalAddress and its kind: every later call fails in this process
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.gpu_check.worker")
    parser.add_argument("factory", help="MODULE:FUNCTION returning the part's cases")
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--inflight", type=Path, required=True)
    parser.add_argument("--deadline", type=float, required=True, help="seconds since the epoch")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    # stopped by the runner (time limit, deadline): unwind, so that a tool this case started is stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    columns, make_cases = load_part(args.factory)
    cases = make_cases(args.quick)
    log = RowLog(args.csv, columns)
    for i in range(args.start, len(cases)):
        if time.time() >= args.deadline:
            return 0  # the runner writes "skipped" rows for what is left
        args.inflight.write_text(f"{i} {time.time():.3f}")
        row = run_case(i, cases[i], log, available)
        print(f"{args.csv.stem}: {cases[i].name} [{cases[i].size}]: {row['status']} {row.get('note', '')}"[:240],
              flush=True)
        if row["status"] == "error" and not context_usable():
            return STICKY_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
