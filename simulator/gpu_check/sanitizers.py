"""Part 3, compute-sanitizer memcheck and racecheck on each probe's awkward paths (``gpu_probe.py --small``), CuPy's
memory pool off so that small out-of-bounds accesses leave their allocation.

A run counts only when the probe printed its completion line and the tool printed its summary (memcheck's
``ERROR SUMMARY: N errors``, racecheck's ``RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)``, as the
first GPU check's H200 runs printed them): the tool refuses some virtualized GPUs ("Device not supported", then error
999 at the first allocation, as issue 19 reports for an H200 under gVisor), and that must read "not run", not "0
errors". The tool's exit code is recorded beside them; a failed run's note starts with the tool's first reports.

One kind of report is not an error of the code under test and is not counted: memcheck reports every CUDA API call
that returns an error, and the CUDA Python bindings that Numba-CUDA loads look up the driver's entry points with
``cuGetProcAddress``, which answers CUDA_ERROR_INVALID_VALUE for those this driver does not have. The second GPU
check's H200 (driver 580.159, cuda-bindings 13.3.1, compute-sanitizer 2025.3.1) printed 34 of them, each with a host
backtrace in the bindings' ``cydriver`` module, for the int8 probe alone and for the SnapKV probe alone, and memcheck
with ``--report-api-errors no`` found 0 errors in both. The row's note says how many were set aside.
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
# the tool's exit status when it reported an error (``--error-exitcode``): not 1, an uncaught exception's
ERROR_EXIT = 86
# the probes in two groups, one process each (a tool's start-up under the sanitizer dominates at these sizes)
PROBES = (("flash", "flash-decode", "standard"), ("int8", "snapkv"))
TOOLS = ("memcheck", "racecheck")


SUMMARY = re.compile(r"ERROR SUMMARY: (?P<memcheck>\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed "
                     r"\((?P<racecheck>\d+) errors?")
# memcheck's report of a failed entry-point lookup and its backtrace's lines (indented further), as the H200 printed:
# 'Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.'
LOOKUP = re.compile(r"^=+[ \t]Program hit CUDA_ERROR_\w+ \(error \d+\).* on CUDA API call to "
                    r"cuGetProcAddress\w*\.[ \t]*(?:\n=+[ \t]{2,}\S.*)*$", re.MULTILINE)
REPORT = re.compile(r"^=+[ \t]+(?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER)(\S.*)$", re.MULTILINE)


def first_reports(output: str, count: int = 3, chars: int = 400) -> str:
    """The tool's first ``count`` distinct report lines ("Invalid __global__ read of size 4 bytes", "at
    ioaware::... ", ...): what kind of error it found, which the output's tail (the probe's own last lines) does
    not say."""
    seen = []
    for line in REPORT.findall(LOOKUP.sub("", output)):
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
    lookups = len(LOOKUP.findall(result.output))
    errors = None if summary is None else int(summary.group("memcheck") or summary.group("racecheck")) - lookups
    row.update(completed="yes" if completed else "no", errors="" if errors is None else errors)
    set_aside = (f"{lookups} failed cuGetProcAddress lookups (the CUDA bindings' start-up) not counted"
                 if lookups else "")
    if result.timed_out:
        return {**row, "status": "timed out", "note": result.tail()}
    if errors:
        return {**row, "status": "failed", "note": _joined(first_reports(result.output), set_aside, result.tail())}
    if errors is None:  # the tool did not check anything (refused the device, or failed to start)
        return {**row, "status": "not run", "note": "no summary line: " + result.tail()}
    if not completed:
        return {**row, "status": "error", "note": "the probe did not complete: " + result.tail()}
    # the tool's --error-exitcode counts the set-aside reports too: with nothing else found, ERROR_EXIT is theirs
    if result.returncode != 0 and not (lookups and result.returncode == ERROR_EXIT):
        note = _joined(f"exit status {result.returncode}", set_aside, result.tail())
        return {**row, "status": "failed", "note": note}
    return {**row, "status": "passed", **({"note": set_aside} if set_aside else {})}


def _joined(*parts: str) -> str:
    return " / ".join(p for p in parts if p)


def _run(probes: tuple[str, ...], tool_check: str) -> Case:
    def run():
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            return {"status": "not run", "note": "compute-sanitizer is not on the PATH"}
        cmd = [tool, "--tool", tool_check, "--error-exitcode", str(ERROR_EXIT), sys.executable, "-m",
               "simulator.gpu_probe", *probes, "--small", "--no-pool"]
        return judge(probes, run_tool(cmd, TOOL_LIMIT_S))

    size = "; ".join(f"{p}: " + " ".join(f"{k}={v}" for k, v in sizes(p, True).items()) for p in probes)
    return Case(name=f"{tool_check} {'+'.join(probes)}", size=size, run=run,
                estimate_s=SANITIZER_START_S + SANITIZER_PROBE_S * len(probes), limit_s=TOOL_LIMIT_S + 30,
                columns={"probe": "+".join(probes), "tool": tool_check})


def cases(quick: bool) -> list[Case]:
    """memcheck on every probe first, then racecheck (so a deadline cuts racecheck, not memcheck)."""
    return [] if quick else [_run(p, t) for t in TOOLS for p in PROBES]
