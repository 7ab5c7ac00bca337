"""Part 4, DRAM bytes: Nsight Compute's ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` over each probe's
kernels (``simulator/gpu_probe.py``), beside the cost model's prediction for the H200 preset.

ncu runs with ``--clock-control none`` (the card's clocks as found; METHOD.md: leave its settings alone) and
``--cache-control all`` (caches flushed before each replay pass: cold-cache DRAM bytes, what the cost model
counts), a time limit of TOOL_LIMIT_S each. The standard baseline runs without a kernel filter, so that cuBLAS's
GEMMs count whatever their names; the other probes launch only their own kernels besides copies.
"""
from __future__ import annotations

import csv
import shutil
import sys

from ._rows import Case
from ._runner import run_tool
from .plan import NCU_RUN_S

COLUMNS = ["probe", "size", "ncu_read_bytes", "ncu_write_bytes", "predicted_bytes", "predicted_over_measured",
           "kernels_profiled", "tool_rc"]
TOOL_LIMIT_S = 90.0
PROBES = ("flash", "int8", "flash-decode", "standard")  # in order of priority; SnapKV has no predicted bytes


def predicted_bytes(probe: str, s: dict) -> float | None:
    """The cost model's DRAM bytes (read + written, through the preset's L2) of a probe on the H200 preset; None
    where it has no counterpart (SnapKV's selection)."""
    from .. import costs
    from ..hardware import load

    h200 = load("H200-SXM")
    if probe == "flash":
        c = costs.flash2_forward(s["B"], s["Hq"], s["Hkv"], s["Nq"], s["Nk"], s["d"], elem_bytes=2, Br=64, Bc=64,
                                hw=h200)
    elif probe == "flash-decode":
        c = costs.decode(s["B"], s["Hq"], s["Hkv"], s["Nk"], s["d"], elem_bytes=2, Bc=64, hw=h200)
    elif probe == "standard":
        c = costs.standard_forward(s["B"], s["Hq"], s["Hkv"], s["Nq"], s["Nk"], s["d"], elem_bytes=2,
                                   hw=h200)
    elif probe == "int8":
        c = costs.int8_split(s["M"], s["K"], s["N"], s["outliers"], elem_bytes=4, out_bytes=4)
    else:
        return None
    return float(c.dram_bytes)


def _kernel_rows(text: str) -> list[tuple[str, float, float]]:
    """(kernel name, read bytes, written bytes) per profiled launch of ncu's ``--csv --page raw`` output."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = []
    for r in csv.DictReader(lines):
        try:
            read = float(str(r.get("dram__bytes_read.sum", "")).replace(",", ""))
            write = float(str(r.get("dram__bytes_write.sum", "")).replace(",", ""))
        except ValueError:
            continue  # the units row
        rows.append((str(r.get("Kernel Name", "")), read, write))
    return rows


def parse_ncu_csv(text: str) -> tuple[float, float, int]:
    """(read bytes, written bytes, kernels) summed over the kernels of ncu's ``--csv --page raw`` output."""
    rows = _kernel_rows(text)
    return sum(r for _, r, _ in rows), sum(w for _, _, w in rows), len(rows)


NAME_CHARS = 48  # of a kernel's name in the per-kernel note (cuBLAS's run to 60 and more)


def _short(name: str) -> str:
    """A kernel's name cut to NAME_CHARS in its middle, its start and end kept (the family; cuBLAS's layout)."""
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS // 2 - 1] + "…" + name[-(NAME_CHARS // 2):]


def by_kernel(text: str, top: int = 6) -> str:
    """The DRAM bytes per kernel name (launches of one name summed), largest first, as "name ×launches read/write
    MB" for the ``top`` largest: where a probe's bytes go, to set beside the cost model's kernels."""
    totals: dict[str, list] = {}
    for name, read, write in _kernel_rows(text):  # by the whole name: cuBLAS's differ late in theirs
        entry = totals.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += read
        entry[2] += write
    ranked = sorted(totals.items(), key=lambda item: -(item[1][1] + item[1][2]))
    parts = [f"{_short(name)} ×{n} {read / 1e6:.1f}/{write / 1e6:.1f} MB" for name, (n, read, write) in ranked[:top]]
    if len(ranked) > top:
        parts.append(f"{len(ranked) - top} more")
    return "by kernel (read/written): " + "; ".join(parts) if parts else ""


def _probe(probe: str) -> Case:
    from ..gpu_probe import KERNEL_REGEX, sizes

    s = sizes(probe, small=False)

    def run():
        pred = predicted_bytes(probe, s)
        row = {"predicted_bytes": f"{pred:.6g}" if pred else ""}
        ncu = shutil.which("ncu")
        if ncu is None:
            return {**row, "status": "not run", "note": "ncu is not on the PATH"}
        kernel_filter = [] if probe == "standard" else ["--kernel-name", f"regex:{KERNEL_REGEX}"]
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--target-processes", "all",
               *kernel_filter, "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum", "--csv", "--page", "raw",
               "--print-units", "base", sys.executable, "-m", "simulator.gpu_probe", probe]
        result = run_tool(cmd, TOOL_LIMIT_S)
        row["tool_rc"] = "" if result.returncode is None else result.returncode
        if result.timed_out:
            return {**row, "status": "timed out", "note": result.tail()}
        read, write, seen = parse_ncu_csv(result.stdout)
        if not seen:
            return {**row, "status": "not run", "note": "ncu read no counters: " + result.tail()}
        row.update(ncu_read_bytes=f"{read:.6g}", ncu_write_bytes=f"{write:.6g}", kernels_profiled=seen)
        if pred:
            row["predicted_over_measured"] = f"{pred / (read + write):.3f}"
        return {**row, "status": "ok", "note": by_kernel(result.stdout)}

    return Case(name=f"ncu {probe}", size=" ".join(f"{k}={v}" for k, v in s.items()), run=run,
                estimate_s=NCU_RUN_S, limit_s=TOOL_LIMIT_S + 30, columns={"probe": probe})


def cases(quick: bool) -> list[Case]:
    return [] if quick else [_probe(p) for p in PROBES]
