"""Part 3, compute-sanitizer memcheck and racecheck on each probe's awkward paths (``gpu_probe.py --small``), CuPy's
memory pool off so that small out-of-bounds accesses leave their allocation.

A run counts only when the probe printed its completion line and the tool printed its ``ERROR SUMMARY``: the tool
refuses some virtualized GPUs ("Device not supported", then error 999 at the first allocation, as issue 19 reports
for an H200 under gVisor), and that must read "not run", not "0 errors". The tool's exit code is recorded beside them.
"""
from __future__ import annotations

import re
import shutil
import sys

from ..gpu_probe import COMPLETION, sizes
from ._rows import Case
from ._runner import run_tool
from .plan import SANITIZER_PROBE_S, SANITIZER_START_S

COLUMNS = ["probe", "tool", "size", "errors", "completed", "tool_rc"]
TOOL_LIMIT_S = 90.0
# the probes in two groups, one process each (a tool's start-up under the sanitizer dominates at these sizes)
PROBES = (("flash", "flash-decode", "standard"), ("int8", "snapkv"))
TOOLS = ("memcheck", "racecheck")


def judge(probes, result) -> dict:
    """The row of one sanitizer run of ``probes`` from its ``ToolRun``: errors, completion, exit code, status."""
    row = {"tool_rc": "" if result.returncode is None else result.returncode}
    if result.missing:
        return {**row, "status": "not run", "note": result.tail()}
    completed = all(COMPLETION.format(case=p) in result.output for p in probes)
    summary = re.search(r"ERROR SUMMARY: (\d+) error", result.output)
    row.update(completed="yes" if completed else "no", errors=summary.group(1) if summary else "")
    if result.timed_out:
        return {**row, "status": "timed out", "note": result.tail()}
    if summary and int(summary.group(1)) > 0:
        return {**row, "status": "failed", "note": result.tail()}
    if not summary:  # the tool did not check anything (refused the device, or failed to start)
        return {**row, "status": "not run", "note": "no ERROR SUMMARY: " + result.tail()}
    if not completed:
        return {**row, "status": "error", "note": "the probe did not complete: " + result.tail()}
    if result.returncode != 0:
        return {**row, "status": "failed", "note": f"exit status {result.returncode}: " + result.tail()}
    return {**row, "status": "passed"}


def _run(probes: tuple[str, ...], tool_check: str) -> Case:
    def run():
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            return {"status": "not run", "note": "compute-sanitizer is not on the PATH"}
        cmd = [tool, "--tool", tool_check, "--error-exitcode", "1", sys.executable, "-m", "simulator.gpu_probe",
               *probes, "--small", "--no-pool"]
        return judge(probes, run_tool(cmd, TOOL_LIMIT_S))

    size = "; ".join(f"{p}: " + " ".join(f"{k}={v}" for k, v in sizes(p, True).items()) for p in probes)
    return Case(name=f"{tool_check} {'+'.join(probes)}", size=size, run=run,
                estimate_s=SANITIZER_START_S + SANITIZER_PROBE_S * len(probes), limit_s=TOOL_LIMIT_S + 30,
                columns={"probe": "+".join(probes), "tool": tool_check})


def cases(quick: bool) -> list[Case]:
    """memcheck on every probe first, then racecheck (so a deadline cuts racecheck, not memcheck)."""
    return [] if quick else [_run(p, t) for t in TOOLS for p in PROBES]
