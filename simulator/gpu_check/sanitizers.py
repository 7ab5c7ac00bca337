"""Part 3, compute-sanitizer memcheck and racecheck on each probe's awkward paths (``gpu_probe.py --small``), CuPy's
memory pool off so that small out-of-bounds accesses leave their allocation.

A run counts only when the probe printed its completion line and the tool printed its summary (memcheck's
``ERROR SUMMARY: N errors``, racecheck's ``RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)``, as the
first GPU check's H200 runs printed them): the tool refuses some virtualized GPUs ("Device not supported", then error
999 at the first allocation, as issue 19 reports for an H200 under gVisor), and that must read "not run", not "0
errors". The tool's exit code is recorded beside them; a failed run's note starts with the tool's first reports.
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


SUMMARY = re.compile(r"ERROR SUMMARY: (?P<memcheck>\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed "
                     r"\((?P<racecheck>\d+) errors?")
REPORT = re.compile(r"^=+[ \t]+(?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER)(\S.*)$", re.MULTILINE)


def first_reports(output: str, count: int = 3, chars: int = 400) -> str:
    """The tool's first ``count`` distinct report lines ("Invalid __global__ read of size 4 bytes", "at
    ioaware::... ", ...): what kind of error it found, which the output's tail (the probe's own last lines) does
    not say."""
    seen = []
    for line in REPORT.findall(output):
        if line.strip() not in seen:
            seen.append(line.strip())
        if len(seen) == count:
            break
    return " / ".join(seen)[:chars]


def judge(probes, result) -> dict:
    """The row of one sanitizer run of ``probes`` from its ``ToolRun``: errors, completion, exit code, status."""
    row = {"tool_rc": "" if result.returncode is None else result.returncode}
    if result.missing:
        return {**row, "status": "not run", "note": result.tail()}
    completed = all(COMPLETION.format(case=p) in result.output for p in probes)
    summary = SUMMARY.search(result.output)
    errors = None if summary is None else int(summary.group("memcheck") or summary.group("racecheck"))
    row.update(completed="yes" if completed else "no", errors="" if errors is None else errors)
    if result.timed_out:
        return {**row, "status": "timed out", "note": result.tail()}
    if errors:
        return {**row, "status": "failed", "note": first_reports(result.output) + " / " + result.tail()}
    if errors is None:  # the tool did not check anything (refused the device, or failed to start)
        return {**row, "status": "not run", "note": "no summary line: " + result.tail()}
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
