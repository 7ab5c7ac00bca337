"""The check's files: ``index.md`` (written before any chart, so a chart that fails costs nothing) and one chart
drawn from the CSV rows."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

FAILING = ("failed", "error", "timed out")  # statuses that make the check exit with status 1


def status_counts(rows) -> str:
    counts = Counter(r["status"] for r in rows)
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rows"


def _table(rows, columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in columns) + " |"
              for r in rows]
    return "\n".join(lines)


INTROS = {
    "machine": "",
    "correctness": "Against the float64 oracles: float32 by the tolerance table, float16/bfloat16 by flash-attn's "
                   "rule (error <= 2 × the same attention done plainly in that precision + half an ulp of the "
                   "output's scale; `kernels.attn.within_tolerance`), int8 and SnapKV exactly.",
    "benchmarks": "CUDA events around `calls_per_timing` back-to-back calls, median of the repeats per call; "
                  "inputs rotated past 4 × L2. TFLOP/s = 4·Nq·Nk·d·B·H / t over the visible pairs (attention), "
                  "2·M·N·K / t (matmuls); GB/s = K and V bytes / t (decode).",
    "sanitizer": "compute-sanitizer on `python -m simulator.gpu_probe PROBE --small --no-pool`; a run counts only "
                 "with the probe's completion line and the tool's summary line (ERROR SUMMARY, RACECHECK SUMMARY).",
    "dram_bytes": "ncu --clock-control none --cache-control all, dram__bytes_read.sum + dram__bytes_write.sum over "
                  "the probe's kernels, beside the cost model's H200 prediction.",
}


def write_index(out_dir: Path, results: dict, header: str) -> Path:
    """``index.md``: the header, then each part's status counts and its rows."""
    md = [f"# ioaware GPU check\n\n{header}\n"]
    for name, (columns, rows) in results.items():
        shown = [c for c in columns if c != "case_id"]
        md += [f"## {name}\n", INTROS.get(name, ""), f"\nRows: {status_counts(rows)}.\n", _table(rows, shown), ""]
    md.append("![benchmarks and DRAM bytes](gpu_check.png)\n")
    path = Path(out_dir) / "index.md"
    path.write_text("\n".join(md))
    return path


def chart(path: Path, bench, dram) -> None:
    """TFLOP/s of the benchmarks that produced one, and DRAM bytes measured beside predicted."""
    from ..report.charts import figure, save

    fig, axes = figure(ncols=2, width=6.5, height=4.5)
    ax = axes[0][0]
    done = [r for r in bench if r.get("tflop_s")]
    ax.barh([f"{r['benchmark']} | {r['tier']}" for r in done], [float(r["tflop_s"]) for r in done],
            color="tab:blue")
    ax.set(xlabel="TFLOP/s (int8: TOP/s), median", title="Measured on this GPU")
    ax.tick_params(axis="y", labelsize=6)
    ax = axes[0][1]
    measured = [r for r in dram if r.get("ncu_read_bytes")]
    if measured:
        x = np.arange(len(measured))
        ax.bar(x - 0.2, [(float(r["ncu_read_bytes"]) + float(r["ncu_write_bytes"])) / 1e9 for r in measured], 0.4,
               label="ncu DRAM bytes")
        ax.bar(x + 0.2, [float(r["predicted_bytes"] or 0) / 1e9 for r in measured], 0.4, label="cost model (H200)")
        ax.set_xticks(x, [r["probe"] for r in measured])
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no DRAM counters on this machine", ha="center", va="center", transform=ax.transAxes)
    ax.set(ylabel="GB read + written", title="DRAM bytes: measured vs predicted")
    save(fig, path)
