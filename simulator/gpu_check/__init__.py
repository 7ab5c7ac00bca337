"""The one-call GPU check: ``python -m simulator gpu-check --out DIR`` (``--dry-run`` lists it without a GPU).

Parts, in order, each in its own module and each case its own CSV row, written as soon as it exists:

0. ``machine``: the card, the packages and tools the run found.
1. ``correctness``: both GPU tiers against the float64 oracles at real sizes.
2. ``benchmarks``: CUDA-event timings beside torch SDPA, cuBLAS and bitsandbytes.
3. ``sanitizer``: compute-sanitizer memcheck and racecheck on the awkward paths.
4. ``dram_bytes``: Nsight Compute DRAM bytes beside the cost model.

Every case runs in a worker process (``worker.py``) under a time limit; a case that raises, crashes its process,
hangs or leaves a sticky CUDA error is a row saying so, and the next case runs in a fresh process. A global
deadline (``--deadline-s``, 420 s by default) is shared among the parts in order of priority
(``plan.part_budget``); what it cuts is a "skipped" row. A missing package (numba-cuda, torch, bitsandbytes) or
tool (ncu, compute-sanitizer) skips only the rows that need it. Files: one CSV per part, ``index.md``,
``gpu_check.png`` and ``gpu_check.log`` (the workers' error output): eight files at most, what a lent machine sends
back.
"""
from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

from ._rows import row_columns
from ._runner import load_part, run_part
from .output import FAILING, chart, status_counts, write_index
from .plan import dry_run, part_budget, part_estimate_s

PARTS = (("machine", "simulator.gpu_check.machine:cases"),
         ("correctness", "simulator.gpu_check.correctness:cases"),
         ("benchmarks", "simulator.gpu_check.benchmarks:cases"),
         ("sanitizer", "simulator.gpu_check.sanitizers:cases"),
         ("dram_bytes", "simulator.gpu_check.ncu:cases"))
DEFAULT_DEADLINE_S = 420.0  # 7 minutes: with a machine's start and the transfers, inside a 15-minute lease

__all__ = ["DEFAULT_DEADLINE_S", "PARTS", "dry_run", "run"]


def run(out_dir: Path, quick: bool = False, deadline_s: float = DEFAULT_DEADLINE_S, progress=print,
        parts=PARTS) -> int:
    """Run the check into ``out_dir`` (new or empty). Returns 0 when no correctness or sanitizer row failed,
    errored or timed out, 1 when one did, 2 when there is no GPU to check or ``out_dir`` holds files."""
    from kernels._common import gpu as _gpu

    if _gpu.cupy_module() is None:
        progress("gpu-check needs CuPy and a CUDA device (see --dry-run for the plan without one)")
        return 2
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        progress(f"--out {out_dir} is not empty; choose a new directory")
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + deadline_s
    estimates = {name: part_estimate_s(load_part(factory)[1](quick)) for name, factory in parts}
    results = {}
    for i, (name, factory) in enumerate(parts):
        budget = part_budget(estimates[name], [estimates[n] for n, _ in parts[i + 1:]], deadline - time.time())
        progress(f"[{time.time() - t0:6.1f} s] {name}: up to {budget:.0f} s (estimated {estimates[name]:.0f} s)")
        rows = run_part(name, factory, out_dir, quick=quick, deadline=time.time() + budget,
                        log_path=out_dir / "gpu_check.log", progress=progress)
        results[name] = (row_columns(load_part(factory)[0]), rows)
        progress(f"[{time.time() - t0:6.1f} s] {name}: {status_counts(rows)}")
        # after each part, so that a run stopped from outside still leaves its summary of what it did
        write_index(out_dir, results, f"In progress: {', '.join(results)} done, {time.time() - t0:.0f} s in.")
    failing = [r for name in ("correctness", "sanitizer") for r in results.get(name, ((), []))[1]
               if r["status"] in FAILING]
    verdict = f"FAILED: {len(failing)} correctness or sanitizer rows" if failing else \
        "No correctness or sanitizer row failed"
    header = (f"Run {_dt.datetime.now().isoformat(timespec='seconds')} by `python -m simulator gpu-check"
              f"{' --quick' if quick else ''} --deadline-s {deadline_s:.0f}` in {time.time() - t0:.0f} s. {verdict} "
              f"(skipped and not-run rows give their reasons).")
    path = write_index(out_dir, results, header)
    progress(f"wrote {path}")
    try:
        chart(out_dir / "gpu_check.png", results.get("benchmarks", ((), []))[1],
              results.get("dram_bytes", ((), []))[1])
    except Exception as err:  # the CSVs and index.md are written; a chart is not worth the run's exit status
        progress(f"chart not drawn: {type(err).__name__}: {err}")
    return 1 if failing else 0
