"""Sections measured on this machine: its calibrated spec, and attention timed beside the cost model's prediction."""
from __future__ import annotations

import math
import os

import numpy as np

import kernels
from kernels.cpuinfo import cache_sizes, cpu_model
from kernels.attn import default_blocks

from .. import costs
from ..measure import peak_memory, time_call
from .charts import ALGO_COLORS, figure, save
from .core import RunContext, Section, planned, read_csv, write_csv

ATTN_HEADS = 8
ATTN_D = 64
ATTN_SIZES = {True: (256, 512, 1024, 2048), False: (512, 1024, 2048, 4096, 8192)}  # keyed by quick


def machine_section(ctx: RunContext) -> Section:
    """This machine: cores and caches from the OS, and the calibrated DRAM bandwidth, sgemm rate and launch cost."""
    pool = kernels.pool_info()
    cpu = ctx.cpu
    rows = [{"property": "cpu_model", "value": cpu_model()},
            {"property": "logical_cores", "value": os.cpu_count()},
            {"property": "numba_threads", "value": pool["threads"]},
            {"property": "threading_layer", "value": pool["threading_layer"]},
            {"property": "wait_policy", "value": pool["wait_policy"]}]
    rows += [{"property": f"{level}_bytes", "value": size} for level, size in sorted(cache_sizes().items())]
    rows += [{"property": "dram_triad_gb_per_s", "value": f"{cpu.hbm_bandwidth / 1e9:.1f}"},
             {"property": "l2_triad_gb_per_s", "value": f"{cpu.sram_bandwidth / 1e9:.1f}"},
             {"property": "sgemm_gflop_per_s", "value": f"{cpu.fp32_flops / 1e9:.1f}"},
             {"property": "parallel_launch_us", "value": f"{cpu.launch_overhead_s * 1e6:.2f}"},
             {"property": "calibrated_on", "value": cpu.measured_on}]
    write_csv(ctx.directory / "machine.csv", rows)
    table = "\n".join(f"| {r['property']} | {r['value']} |" for r in rows)
    body = (f"The cost model's `cpu` spec, calibrated on this machine on {cpu.measured_on}: DRAM bandwidth from a "
            f"STREAM-style triad on all cores (32 bytes moved per element, write-allocate included), peak FLOP/s "
            f"from a 2048³ sgemm, and one core's L2 as the \"SRAM\" of the flash tiles. The kernels ran on "
            f"{pool['threads']} Numba threads ({pool['threading_layer']} layer, wait policy "
            f"{pool['wait_policy']}).\n\n"
            f"| property | value |\n|---|---|\n{table}\n\nData: [machine.csv](machine.csv)\n")
    return Section("This machine", body, ("machine.csv",))


def attention_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """FLOPs of the attention forward: 2·N²·d for QKᵀ plus 2·N²·d for PV per head (FlashAttention-2 §4.1's
    count, 4·N²·d·H), halved with a causal mask."""
    flops = 4.0 * n * n * d * heads
    return flops / 2 if causal else flops


def _predict(cpu, algorithm, n, causal):
    """Roofline seconds of one call on this machine's calibrated spec, with the kernels' real tile sizes."""
    br, bc = default_blocks(ATTN_D, 4)
    model = costs.standard_forward if algorithm == "standard" else costs.flash2_forward
    cost = model(1, ATTN_HEADS, ATTN_HEADS, n, n, ATTN_D, causal=causal, elem_bytes=4,
                 sram_bytes=cpu.sram_per_sm_bytes, Br=br, Bc=bc)
    timing = cost.time(cpu)
    bound = "+".join(sorted({str(k.bound) for k in timing.kernels}))
    return float(timing.seconds), int(cost.hbm_bytes), bound


@planned(lambda quick: 4 * len(ATTN_SIZES[quick]))  # standard and flash, with and without the mask
def attention_cpu_section(ctx: RunContext) -> Section:
    """Time and peak memory of standard vs flash attention on this CPU vs N (B=1, H=8, d=64, float32), beside the
    time the cost model predicts for each with the calibrated spec."""
    rng = np.random.default_rng(ctx.seed)
    rows = []
    repeats = 3 if ctx.quick else 5
    for n in ATTN_SIZES[ctx.quick]:
        q, k, v = (rng.standard_normal((1, ATTN_HEADS, n, ATTN_D), dtype=np.float32) for _ in range(3))
        expected = kernels.attention(q, k, v, causal=False, algorithm="flash")
        for causal in (False, True):
            for algorithm in ("standard", "flash"):
                ctx.step(f"attention {algorithm} N={n} causal={causal}")

                def call(q=q, k=k, v=v, causal=causal, algorithm=algorithm):
                    return kernels.attention(q, k, v, causal=causal, algorithm=algorithm)

                if not causal and algorithm == "standard":
                    # the two algorithms must agree before they are compared
                    err = float(np.max(np.abs(call() - expected)))
                    if err > 1e-4:
                        raise RuntimeError(f"standard and flash attention disagree at N={n}: max |diff| {err}")
                timing = time_call(call, repeats=repeats)
                memory = peak_memory(call)
                predicted_s, predicted_bytes, bound = _predict(ctx.cpu, algorithm, n, causal)
                rows.append({
                    "algorithm": algorithm, "causal": causal, "n": n, "heads": ATTN_HEADS, "d": ATTN_D,
                    "dtype": "float32", "measured_s": f"{timing.median_s:.6g}", "measured_min_s": f"{timing.min_s:.6g}",
                    "gflops_per_s": f"{attention_flops(n, ATTN_D, ATTN_HEADS, causal) / timing.median_s / 1e9:.4g}",
                    "peak_traced_bytes": memory.traced_bytes, "peak_rss_growth_bytes": memory.rss_bytes,
                    "predicted_s": f"{predicted_s:.6g}", "predicted_hbm_bytes": predicted_bytes,
                    "predicted_bound": bound,
                })
    write_csv(ctx.directory / "attention_cpu.csv", rows)
    llc = cache_sizes().get("L3", cache_sizes().get("L2", 0))
    plot_attention_cpu(ctx.directory / "attention_cpu.csv", ctx.directory / "attention_cpu.png", llc)
    return Section("Attention on this CPU: measured, and predicted by the cost model", _attention_markdown(rows, llc),
                   ("attention_cpu.csv", "attention_cpu.png"))


def n_where_scores_fit(llc_bytes: int) -> float:
    """The N at which S and P (2 · H · N² float32) fill the last-level cache."""
    return math.sqrt(llc_bytes / (2 * ATTN_HEADS * 4)) if llc_bytes else 0.0


def _attention_markdown(rows: list[dict], llc: int) -> str:
    by_key = {(r["algorithm"], r["causal"], r["n"]): r for r in rows}
    lines = ["Batch 1, 8 heads, d = 64, float32; median of repeated calls; GFLOP/s = 4·N²·d·H / t (half for "
             "causal). *Predicted* is the roofline time of the cost model on the calibrated spec above, with the "
             "kernel's own tile sizes; peak memory is the allocation during the call, output included "
             "(tracemalloc).", "",
             "| N | causal | standard s | flash s | measured speedup | predicted speedup | standard MiB | flash MiB |",
             "|---|---|---|---|---|---|---|---|"]
    gaps = []
    for (algorithm, causal, n), std in by_key.items():
        if algorithm != "standard":
            continue
        fl = by_key[("flash", causal, n)]
        measured = float(std["measured_s"]) / float(fl["measured_s"])
        predicted = float(std["predicted_s"]) / float(fl["predicted_s"])
        gaps.append((n, causal, measured, predicted))
        lines.append(f"| {n} | {causal} | {float(std['measured_s']):.4f} | {float(fl['measured_s']):.4f} | "
                     f"{measured:.2f}× | {predicted:.2f}× | {int(std['peak_traced_bytes']) / 2**20:.1f} | "
                     f"{int(fl['peak_traced_bytes']) / 2**20:.1f} |")
    n_fit = n_where_scores_fit(llc)
    largest = max(gaps, key=lambda g: (g[0], g[1]))
    n_big = largest[0]
    std_big, fl_big = by_key[("standard", False, n_big)], by_key[("flash", False, n_big)]
    std_ratio = float(std_big["measured_s"]) / float(std_big["predicted_s"])
    fl_ratio = float(fl_big["measured_s"]) / float(fl_big["predicted_s"])
    direction = "understates" if largest[2] > largest[3] else "overstates"
    lines += ["", "![measured and predicted attention time on this CPU](attention_cpu.png)", "",
              f"The left chart puts the measured time (solid) beside the roofline prediction (dashed). At N = "
              f"{n_big} (no mask) flash took {fl_ratio:.2f}× its predicted time and the standard algorithm "
              f"{std_ratio:.2f}× its own: the roofline charges the softmax at DRAM bandwidth on all cores, while "
              f"NumPy runs it as several elementwise passes on one core, and it counts no exp. So the model "
              f"{direction} the speedup here ({'causal' if largest[1] else 'no mask'}, N = {n_big}: "
              f"{largest[2]:.2f}× measured, {largest[3]:.2f}× predicted). The grey line marks N ≈ {n_fit:.0f}, "
              f"below which S and P together fit in the {llc / 2**20:.0f} MiB last-level cache: there the "
              f"standard algorithm's S and P traffic never reaches DRAM, so its DRAM-bandwidth term is "
              f"pessimistic.",
              "", "Data: [attention_cpu.csv](attention_cpu.csv)"]
    return "\n".join(lines) + "\n"


def plot_attention_cpu(csv_path, png_path, llc_bytes: int) -> None:
    """Three panels from the CSV: time vs N (measured and predicted), speedup vs N, peak memory vs N."""
    rows = read_csv(csv_path)
    fig, axes = figure(ncols=3, width=5.0)
    ax_t, ax_s, ax_m = axes[0]
    colors = {"standard": ALGO_COLORS["standard"], "flash": ALGO_COLORS["flash2"]}
    for algorithm in ("standard", "flash"):
        sel = [r for r in rows if r["algorithm"] == algorithm and r["causal"] == "False"]
        n = [int(r["n"]) for r in sel]
        ax_t.plot(n, [float(r["measured_s"]) for r in sel], "-o", color=colors[algorithm], label=f"{algorithm} measured")
        ax_t.plot(n, [float(r["predicted_s"]) for r in sel], "--", color=colors[algorithm],
                  label=f"{algorithm} predicted")
        for causal, style in (("False", "-o"), ("True", "--s")):
            sel = [r for r in rows if r["algorithm"] == algorithm and r["causal"] == causal]
            ax_m.plot([int(r["n"]) for r in sel], [int(r["peak_traced_bytes"]) / 2**20 for r in sel], style,
                      color=colors[algorithm], label=f"{algorithm}{' causal' if causal == 'True' else ''}")
    for causal, style in (("False", "-o"), ("True", "-s")):
        std = {r["n"]: r for r in rows if r["algorithm"] == "standard" and r["causal"] == causal}
        fl = {r["n"]: r for r in rows if r["algorithm"] == "flash" and r["causal"] == causal}
        n = sorted(std, key=int)
        label = "causal" if causal == "True" else "no mask"
        ax_s.plot([int(x) for x in n], [float(std[x]["measured_s"]) / float(fl[x]["measured_s"]) for x in n], style,
                  color="tab:green" if causal == "False" else "tab:purple", label=f"measured, {label}")
        ax_s.plot([int(x) for x in n], [float(std[x]["predicted_s"]) / float(fl[x]["predicted_s"]) for x in n],
                  "--", color="tab:green" if causal == "False" else "tab:purple", label=f"predicted, {label}")
    ax_s.axhline(1.0, color="black", linewidth=0.8)
    n_fit = n_where_scores_fit(llc_bytes)
    for ax in (ax_t, ax_s):
        if n_fit:
            ax.axvline(n_fit, color="grey", linestyle=":", label="S + P fill the last-level cache")
    ax_t.set(yscale="log", ylabel="time per call (s)", title="time: measured vs roofline prediction")
    ax_s.set(ylabel="speedup of flash over standard (×)", title="speedup: measured vs predicted")
    ax_m.set(yscale="log", ylabel="peak memory during the call (MiB)", title="memory: S and P vs O(N·d)")
    for ax in (ax_t, ax_s, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (B=1, H=8, d=64, float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, png_path)
