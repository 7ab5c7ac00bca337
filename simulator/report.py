"""The report: measured sections written as CSV first, charts drawn from the CSV, then a Markdown page.

A report is a run directory. It is built in a temporary directory beside the target and renamed into place at
the end, so an interrupted run leaves no half report. Each section is a function that takes a ``RunContext`` and
returns a ``Section``; the int8, SnapKV and cost-model sections plug into ``SECTIONS`` the same way.
"""
from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import kernels
from kernels._cpuinfo import cache_sizes

from .measure import peak_memory, time_call


@dataclass
class RunContext:
    """What every section gets: where to write, how long it may take, a seed, and a progress callback."""

    directory: Path
    quick: bool
    seed: int = 0
    progress: object = None  # a callable(description: str) -> None, or None

    def step(self, description: str) -> None:
        if self.progress is not None:
            self.progress(description)


@dataclass(frozen=True)
class Section:
    """One part of the report: its heading, Markdown body, and the files it wrote (relative paths)."""

    title: str
    markdown: str
    files: tuple[str, ...] = field(default_factory=tuple)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write dict rows with the first row's keys as the header (units belong in the column names)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------------------------
# This machine

def machine_section(ctx: RunContext) -> Section:
    """Cores and caches as the OS reports them (the calibrated spec of the cost-model issue extends this)."""
    caches = cache_sizes()
    rows = [{"property": "processor", "value": platform.processor() or platform.machine()},
            {"property": "cpu_model", "value": _cpu_model()},
            {"property": "logical_cores", "value": os.cpu_count()},
            {"property": "numba_threads", "value": _numba_threads()}]
    rows += [{"property": f"{level}_bytes", "value": size} for level, size in sorted(caches.items())]
    write_csv(ctx.directory / "machine.csv", rows)
    table = "\n".join(f"| {r['property']} | {r['value']} |" for r in rows)
    body = f"| property | value |\n|---|---|\n{table}\n\nData: [machine.csv](machine.csv)\n"
    return Section("This machine", body, ("machine.csv",))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


# ---------------------------------------------------------------------------------------------------------------
# Attention measured on this CPU

ATTN_HEADS = 8
ATTN_D = 64
ATTN_SIZES = {True: (256, 512, 1024, 2048), False: (512, 1024, 2048, 4096, 8192)}  # keyed by quick


def attention_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """FLOPs of the attention forward: 2·N²·d for QKᵀ plus 2·N²·d for PV per head (FlashAttention-2 §4.1's
    count, 4·N²·d·H), halved with a causal mask."""
    flops = 4.0 * n * n * d * heads
    return flops / 2 if causal else flops


def attention_cpu_section(ctx: RunContext) -> Section:
    """Time and peak memory of standard vs flash attention on this CPU, vs N (B=1, H=8, d=64, float32)."""
    rng = np.random.default_rng(ctx.seed)
    rows = []
    repeats = 3 if ctx.quick else 5
    for n in ATTN_SIZES[ctx.quick]:
        q, k, v = (rng.standard_normal((1, ATTN_HEADS, n, ATTN_D), dtype=np.float32) for _ in range(3))
        expected = kernels.attention(q, k, v, causal=False, algorithm="flash")
        for causal in (False, True):
            for algorithm in ("standard", "flash"):
                ctx.step(f"attention {algorithm} N={n} causal={causal}")

                def call():
                    return kernels.attention(q, k, v, causal=causal, algorithm=algorithm)

                if not causal and algorithm == "standard":
                    # the two algorithms must agree before they are compared
                    err = float(np.max(np.abs(call() - expected)))
                    if err > 1e-4:
                        raise RuntimeError(f"standard and flash attention disagree at N={n}: max |diff| {err}")
                timing = time_call(call, repeats=repeats)
                memory = peak_memory(call)
                rows.append({
                    "algorithm": algorithm, "causal": causal, "n": n, "heads": ATTN_HEADS, "d": ATTN_D,
                    "dtype": "float32", "median_s": f"{timing.median_s:.6g}", "min_s": f"{timing.min_s:.6g}",
                    "gflops_per_s": f"{attention_flops(n, ATTN_D, ATTN_HEADS, causal) / timing.median_s / 1e9:.4g}",
                    "peak_traced_bytes": memory.traced_bytes, "peak_rss_growth_bytes": memory.rss_bytes,
                })
    write_csv(ctx.directory / "attention_cpu.csv", rows)
    plot_attention_cpu(ctx.directory / "attention_cpu.csv", ctx.directory / "attention_cpu.png")
    return Section("Attention on this CPU: standard vs flash", _attention_markdown(rows),
                   ("attention_cpu.csv", "attention_cpu.png"))


def _attention_markdown(rows: list[dict]) -> str:
    by_key = {(r["algorithm"], r["causal"], r["n"]): r for r in rows}
    lines = ["Batch 1, 8 heads, d = 64, float32; median of repeated calls. GFLOP/s = 4·N²·d·H / t "
             "(half for causal). Peak memory: NumPy's allocations during the call, output included (tracemalloc).", "",
             "| N | causal | standard s | flash s | speedup | standard MiB | flash MiB |",
             "|---|---|---|---|---|---|---|"]
    for (algorithm, causal, n), std in by_key.items():
        if algorithm != "standard":
            continue
        fl = by_key[("flash", causal, n)]
        speedup = float(std["median_s"]) / float(fl["median_s"])
        lines.append(f"| {n} | {causal} | {float(std['median_s']):.4f} | {float(fl['median_s']):.4f} | "
                     f"{speedup:.2f}× | {int(std['peak_traced_bytes']) / 2**20:.1f} | "
                     f"{int(fl['peak_traced_bytes']) / 2**20:.1f} |")
    lines += ["", "![standard vs flash attention on this CPU](attention_cpu.png)", "",
              "Data: [attention_cpu.csv](attention_cpu.csv)"]
    return "\n".join(lines) + "\n"


def plot_attention_cpu(csv_path: Path, png_path: Path) -> None:
    """Two panels drawn from the CSV: median time vs N and peak memory vs N, per algorithm and mask."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(csv_path)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for algorithm, color in (("standard", "tab:red"), ("flash", "tab:blue")):
        for causal, style in (("False", "-"), ("True", "--")):
            sel = [r for r in rows if r["algorithm"] == algorithm and r["causal"] == causal]
            if not sel:
                continue
            n = [int(r["n"]) for r in sel]
            label = f"{algorithm}{' causal' if causal == 'True' else ''}"
            ax_t.plot(n, [float(r["median_s"]) for r in sel], style, color=color, marker="o", label=label)
            ax_m.plot(n, [int(r["peak_traced_bytes"]) / 2**20 for r in sel], style, color=color, marker="o",
                      label=label)
    for ax, ylabel in ((ax_t, "median time (s)"), (ax_m, "peak memory above the inputs, output included (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_title("time (B=1, H=8, d=64, float32)")
    ax_m.set_title("memory: S and P vs O(N·d)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


SECTIONS = (machine_section, attention_cpu_section)


def default_out_dir(hardware: str = "cpu") -> Path:
    """``reports/runs/<date>T<time>-<hardware>`` under the current directory."""
    stamp = _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    return Path("reports") / "runs" / f"{stamp}-{hardware}"


def build_report(out_dir: Path, *, quick: bool = False, seed: int = 0, progress=None, sections=SECTIONS) -> Path:
    """Run every section into a temporary directory, write ``index.md``, then rename it to ``out_dir``.

    Raises ``FileExistsError`` if ``out_dir`` exists (a report is never overwritten in place).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"output directory {out_dir} already exists; choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        ctx = RunContext(directory=tmp, quick=quick, seed=seed, progress=progress)
        results = [section(ctx) for section in sections]
        mode = "quick" if quick else "full"
        header = (f"# ioaware report\n\nMode: {mode}; seed {seed}; generated "
                  f"{_dt.datetime.now().isoformat(timespec='seconds')} by `python -m simulator report`.\n")
        parts = [header] + [f"## {s.title}\n\n{s.markdown}" for s in results]
        (tmp / "index.md").write_text("\n".join(parts))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
