"""Sections measured on this machine: its calibrated spec, and attention timed beside the cost model's prediction."""
from __future__ import annotations

import math
import os

import numpy as np

import kernels
from kernels import int8
from kernels.cpuinfo import cache_sizes, cpu_model
from kernels.attn import default_blocks

from .. import costs
from ..calibrate import dram_test_bytes, filled
from ..calibrate_phases import phase_rates
from ..costs import phases
from ..hardware.spec import safe_name
from ..measure import peak_memory, time_call
from .charts import ALGO_COLORS, figure, save
from .core import RunContext, Section, planned, read_csv, write_csv

ATTN_HEADS = 8
ATTN_D = 64
# keyed by quick. The quick report stops at N = 1024 (S and P of 8 heads: 64 MiB, past a 32 MiB L3 already): N = 2048
# took 10 s of its 61 (2-vCPU AMD EPYC, Zen 4), and ``--quick`` promises under a minute on two cores
ATTN_SIZES = {True: (256, 512, 1024), False: (512, 1024, 2048, 4096, 8192)}


def dram_buffer(ctx: RunContext):
    """A float32 array of ``dram_test_bytes()`` (twice the largest cache), its pages mapped, made once per run:
    the calibrations read it, and the decode GEMVs of the int8 section stream their layers from it."""
    if ctx.dram_buffer is None:
        ctx.dram_buffer = filled(dram_test_bytes() // 4, 1.0, np.float32)
    return ctx.dram_buffer


def streamed_buffer(ctx: RunContext, k: int):
    """A buffer for ``simulator.measure.streamed_gemv_seconds`` at K = N = ``k``: ``dram_buffer(ctx)``, or where
    that cannot hold two k × k float32 layers (twice the largest cache is less than 2·4·k² bytes: a machine whose
    OS reports a last-level cache under 256 MiB, at k = 8192) a mapped one of two layers."""
    buffer = dram_buffer(ctx)
    return buffer if buffer.size >= 2 * k * k else filled(2 * k * k, 1.0, np.float32)


def rates_now(ctx: RunContext):
    """This machine's per-phase rates (``simulator.costs.phases.PhaseRates``), measured in this run, once: the
    predictions are compared with timings taken minutes later on the same, shared, machine."""
    if ctx.phase_rates is None:
        ctx.phase_rates = phase_rates(spec=ctx.cpu, buffer=dram_buffer(ctx))
    return ctx.phase_rates


def fresh_rates(ctx: RunContext):
    """The per-phase rates for the measurements that follow: in the full report measured again now (each section,
    and each attention size, is compared with rates measured just before it, as other processes come and go on a
    shared machine), in the quick report the run's first measurement (``rates_now``)."""
    if ctx.quick:
        return rates_now(ctx)
    ctx.phase_rates = phase_rates(spec=ctx.cpu, buffer=dram_buffer(ctx))
    return ctx.phase_rates


# the per-phase rates the machine table shows: (field, label, factor, unit)
RATE_ROWS = (("llc_bytes", "effective_llc_mib", 2**20, ""), ("read_all", "read_all_cores_gb_per_s", 1e9, ""),
             ("read_one_dram", "read_1core_dram_gb_per_s", 1e9, ""),
             ("read_one_llc", "read_1core_llc_gb_per_s", 1e9, ""),
             ("int8_gemv_dram", "int8_gemv_all_cores_dram_gb_per_s", 1e9, ""),
             ("int8_gemv_one_llc", "int8_gemv_1core_llc_gb_per_s", 1e9, ""),
             ("int8_gemv_one_dram", "int8_gemv_1core_dram_gb_per_s", 1e9, ""),
             ("int8_outlier_s", "int8_outlier_per_output_per_thread_ns", 1e-9, ""),
             ("reduce_dram", "numpy_row_reduce_1core_dram_gb_per_s", 1e9, ""),
             ("update_dram", "numpy_inplace_update_1core_dram_gb_per_s", 1e9, ""),
             ("into_dram", "numpy_into_mapped_array_1core_dram_gb_per_s", 1e9, ""),
             ("divide_dram", "numpy_inplace_divide_1core_dram_gb_per_s", 1e9, ""),
             ("fresh_dram", "numpy_into_new_array_1core_dram_gb_per_s", 1e9, ""),
             ("exp_llc", "numpy_exp_inplace_1core_llc_g_per_s", 1e9, ""),
             ("exp_dram", "numpy_exp_inplace_1core_dram_g_per_s", 1e9, ""),
             ("first_touch_all", "page_faults_all_cores_gb_per_s", 1e9, ""),
             ("gemm_qk", "gemm_qk_k64_gflop_per_s", 1e9, ""), ("gemm_pv", "gemm_pv_n64_gflop_per_s", 1e9, ""),
             ("gemm_block", "flash_block_products_per_thread_gflop_per_s", 1e9, ""),
             ("exp_block", "flash_exp_per_thread_g_per_s", 1e9, ""),
             ("attention_call_s", "attention_call_us", 1e-6, ""), ("calibration_s", "phase_calibration_s", 1, ""))


@planned(lambda quick: 1)  # the per-phase rates
def machine_section(ctx: RunContext) -> Section:
    """This machine: cores and caches from the OS, the calibrated DRAM bandwidth, sgemm rate and launch cost, and
    the per-phase rates measured in this run."""
    pool = kernels.pool_info()
    cpu = ctx.cpu
    ctx.step("calibrate the per-phase rates")
    rates = rates_now(ctx)
    rows = [{"property": "cpu_model", "value": safe_name(cpu_model())},  # (no markup from the CPU's string)
            {"property": "logical_cores", "value": os.cpu_count()},
            {"property": "numba_threads", "value": pool["threads"]},
            {"property": "threading_layer", "value": pool["threading_layer"]},
            {"property": "wait_policy", "value": pool["wait_policy"]},
            {"property": "steer_workers", "value": pool["steer_workers"]},
            {"property": "serial_when_held", "value": pool["serial_when_held"]},
            {"property": "int8_products", "value": int8.product_path()}]
    rows += [{"property": f"{level}_bytes", "value": size} for level, size in sorted(cache_sizes().items())]
    rows += [{"property": "dram_triad_gb_per_s", "value": f"{cpu.hbm_bandwidth / 1e9:.1f}"},
             {"property": "l2_triad_gb_per_s", "value": f"{cpu.sram_bandwidth / 1e9:.1f}"},
             {"property": "sgemm_gflop_per_s", "value": f"{cpu.fp32_flops / 1e9:.1f}"},
             {"property": "parallel_launch_us", "value": f"{cpu.launch_overhead_s * 1e6:.2f}"},
             {"property": "calibrated_on", "value": cpu.measured_on}]
    rows += [{"property": label, "value": f"{getattr(rates, field) / factor:.4g}"}
             for field, label, factor, _ in RATE_ROWS]
    write_csv(ctx.directory / "machine.csv", rows)
    table = "\n".join(f"| {r['property']} | {r['value']} |" for r in rows)
    body = (f"The cost model's `cpu` spec, calibrated on this machine on {cpu.measured_on}: DRAM bandwidth from a "
            f"STREAM-style triad on all cores (32 bytes moved per element, write-allocate included), peak FLOP/s "
            f"from a 2048³ sgemm, and one core's L2 as the \"SRAM\" of the flash tiles. The kernels ran on "
            f"{pool['threads']} Numba threads ({pool['threading_layer']} layer, wait policy "
            f"{pool['wait_policy']}; int8 products on {int8.product_path()}). The per-phase rates below them "
            f"(``simulator.costs.phases``) were measured at the start of this run in {rates.calibration_s:.1f} s: "
            f"what one core reaches in NumPy's passes "
            f"(from the cache and from DRAM), the kernels' matmuls and exps on all threads, and the fixed cost of "
            f"one call; the effective last-level cache is where one core's read rate falls half-way to DRAM's.\n\n"
            f"| property | value |\n|---|---|\n{table}\n\nData: [machine.csv](machine.csv)\n")
    return Section("This machine", body, ("machine.csv",))


def attention_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """FLOPs of the attention forward: 2·N²·d for QKᵀ plus 2·N²·d for PV per head (FlashAttention-2 §4.1's
    count, 4·N²·d·H), halved with a causal mask."""
    flops = 4.0 * n * n * d * heads
    return flops / 2 if causal else flops


def _roofline(cpu, algorithm, n, causal):
    """Roofline seconds of one call on this machine's calibrated spec, with the kernels' real tile sizes."""
    br, bc = default_blocks(ATTN_D, 4)
    model = costs.standard_forward if algorithm == "standard" else costs.flash2_forward
    cost = model(1, ATTN_HEADS, ATTN_HEADS, n, n, ATTN_D, causal=causal, elem_bytes=4,
                 sram_bytes=cpu.sram_per_sm_bytes, Br=br, Bc=bc)
    timing = cost.time(cpu)
    bound = "+".join(sorted({str(k.bound) for k in timing.kernels}))
    return float(timing.seconds), int(cost.hbm_bytes), bound


def predicted_phases(rates, algorithm, n, causal):
    """The per-phase prediction of one call (B=1, H=8, d=64, float32) with the kernels' real tile sizes."""
    if algorithm == "standard":
        return phases.standard_phases(rates, 1, ATTN_HEADS, ATTN_HEADS, n, n, ATTN_D, causal=causal)
    br, bc = default_blocks(ATTN_D, 4)
    return phases.flash_phases(rates, 1, ATTN_HEADS, ATTN_HEADS, n, n, ATTN_D, causal=causal, Br=br, Bc=bc)


def error_pct(predicted: float, measured: float) -> float:
    """(predicted − measured) / measured, in percent."""
    return 100.0 * (predicted - measured) / measured


PHASE_REPEATS = 3  # timed runs of the standard algorithm's phases per size (median per phase)


@planned(lambda quick: 4 * len(ATTN_SIZES[quick]))  # standard and flash, with and without the mask
def attention_cpu_section(ctx: RunContext) -> Section:
    """Time and peak memory of standard vs flash attention on this CPU vs N (B=1, H=8, d=64, float32), beside the
    time the per-phase model predicts with the rates measured in this run (and the roofline's, for contrast);
    the standard algorithm's phases are timed one by one beside their predictions."""
    rng = np.random.default_rng(ctx.seed)
    rows, phase_rows = [], []
    repeats = 3 if ctx.quick else 5
    for n in ATTN_SIZES[ctx.quick]:
        rates = fresh_rates(ctx)
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
                predicted = predicted_phases(rates, algorithm, n, causal)
                predicted_s = phases.total_seconds(predicted)
                roofline_s, predicted_bytes, bound = _roofline(ctx.cpu, algorithm, n, causal)
                measured_phase = {}
                # the phases one by one: at every size in the full report, at the largest in the quick one
                if algorithm == "standard" and (not ctx.quick or n == max(ATTN_SIZES[ctx.quick])):
                    runs = [kernels.attn.standard_phase_times(q, k, v, causal=causal)[1]
                            for _ in range(PHASE_REPEATS)]
                    measured_phase = {name: float(np.median([r[name] for r in runs])) for name in runs[0]}
                for phase in predicted:
                    got = measured_phase.get(phase.name)
                    phase_rows.append({"algorithm": algorithm, "causal": causal, "n": n, "phase": phase.name,
                                       "kind": phase.kind, "threads": phase.threads,
                                       "predicted_s": f"{phase.seconds:.6g}",
                                       "measured_s": "" if got is None else f"{got:.6g}"})
                rows.append({
                    "algorithm": algorithm, "causal": causal, "n": n, "heads": ATTN_HEADS, "d": ATTN_D,
                    "dtype": "float32", "measured_s": f"{timing.median_s:.6g}", "measured_min_s": f"{timing.min_s:.6g}",
                    "gflops_per_s": f"{attention_flops(n, ATTN_D, ATTN_HEADS, causal) / timing.median_s / 1e9:.4g}",
                    "peak_traced_bytes": memory.traced_bytes, "peak_rss_growth_bytes": memory.rss_bytes,
                    "predicted_s": f"{predicted_s:.6g}",
                    "error_pct": f"{error_pct(predicted_s, timing.median_s):.1f}",
                    "roofline_s": f"{roofline_s:.6g}", "predicted_hbm_bytes": predicted_bytes,
                    "roofline_bound": bound,
                })
    write_csv(ctx.directory / "attention_cpu.csv", rows)
    write_csv(ctx.directory / "attention_phases.csv", phase_rows)
    llc = cache_sizes().get("L3", cache_sizes().get("L2", 0))
    plot_attention_cpu(ctx.directory / "attention_cpu.csv", ctx.directory / "attention_cpu.png", llc)
    return Section("Attention on this CPU: measured, and predicted by the cost model",
                   _attention_markdown(rows, phase_rows, llc, rates),
                   ("attention_cpu.csv", "attention_phases.csv", "attention_cpu.png"))


def n_where_scores_fit(llc_bytes: int) -> float:
    """The N at which S and P (2 · H · N² float32) fill the last-level cache."""
    return math.sqrt(llc_bytes / (2 * ATTN_HEADS * 4)) if llc_bytes else 0.0


def _attention_markdown(rows: list[dict], phase_rows: list[dict], llc: int, rates) -> str:
    by_key = {(r["algorithm"], r["causal"], r["n"]): r for r in rows}
    lines = ["Batch 1, 8 heads, d = 64, float32; median of repeated calls; GFLOP/s = 4·N²·d·H / t (half for "
             "causal). *Predicted* is the per-phase model (`simulator.costs.phases`) on the rates measured in this "
             "run (before each size in the full report, once in the quick one): the standard algorithm's matmuls on all threads and its softmax passes on one "
             "core, in NumPy, each at its own measured rate; the flash kernel's block products, exps and rescale "
             "per thread. *Roofline* is `Cost.time` on the calibrated spec (all-core DRAM bandwidth, no exp), for "
             "contrast. Error = (predicted − measured) / measured. The machine is shared: other processes may have "
             "run beside any measurement.", "",
             "| N | causal | standard s | predicted | error | flash s | predicted | error | measured speedup | "
             "predicted speedup | roofline speedup | standard MiB | flash MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (algorithm, causal, n), std in by_key.items():
        if algorithm != "standard":
            continue
        fl = by_key[("flash", causal, n)]
        measured = float(std["measured_s"]) / float(fl["measured_s"])
        predicted = float(std["predicted_s"]) / float(fl["predicted_s"])
        roofline = float(std["roofline_s"]) / float(fl["roofline_s"])
        lines.append(f"| {n} | {causal} | {float(std['measured_s']):.4f} | {float(std['predicted_s']):.4f} | "
                     f"{float(std['error_pct']):+.0f}% | {float(fl['measured_s']):.4f} | "
                     f"{float(fl['predicted_s']):.4f} | {float(fl['error_pct']):+.0f}% | {measured:.2f}× | "
                     f"{predicted:.2f}× | {roofline:.2f}× | {int(std['peak_traced_bytes']) / 2**20:.1f} | "
                     f"{int(fl['peak_traced_bytes']) / 2**20:.1f} |")
    n_big = max(int(r["n"]) for r in rows)
    lines += ["", f"**Per phase at N = {n_big}** (milliseconds; the standard algorithm's phases timed one by one "
              f"inside the kernel, `kernels.attn.standard_phase_times`, median of {PHASE_REPEATS} runs; the flash "
              f"kernel's phases are predicted only, its total measured above; *threads* is what the phase runs "
              f"on):", "",
              "| algorithm | causal | phase | kind | threads | predicted ms | measured ms | error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in phase_rows:
        if int(r["n"]) != n_big:
            continue
        got = r["measured_s"]
        err = f"{error_pct(float(r['predicted_s']), float(got)):+.0f}%" if got else ""
        lines.append(f"| {r['algorithm']} | {r['causal']} | {r['phase']} | {r['kind']} | {r['threads']} | "
                     f"{float(r['predicted_s']) * 1e3:.2f} | {float(got) * 1e3 if got else float('nan'):.2f} | "
                     f"{err} |".replace("| nan |", "| |"))
    std_big = by_key[("standard", False, n_big)]
    single = sum(float(r["predicted_s"]) for r in phase_rows if r["algorithm"] == "standard" and
                 not r["causal"] and int(r["n"]) == n_big and int(r["threads"]) == 1)
    n_fit = n_where_scores_fit(llc)
    lines += ["", "![measured and predicted attention time on this CPU](attention_cpu.png)", "",
              f"At N = {n_big} (no mask) the one-core passes are {100 * single / float(std_big['predicted_s']):.0f}% "
              f"of the standard algorithm's predicted time: NumPy's in-place exp alone runs at "
              f"{rates.exp_dram / 1e9:.2f} G elements/s from DRAM, and P is written into a new array whose pages "
              f"are faulted in on one core ({rates.fresh_dram / 1e9:.1f} GB/s of reads and writes). The roofline "
              f"charges these passes at all-core DRAM bandwidth and counts no exp, which is why its speedup is "
              f"far below the measured one. The grey line marks N ≈ {n_fit:.0f}, below which S and P together "
              f"fit in the {llc / 2**20:.0f} MiB the OS reports as last-level cache; the passes run at cache speed "
              f"only up to the {rates.llc_bytes / 2**20:.0f} MiB measured.",
              "", "Data: [attention_cpu.csv](attention_cpu.csv), [attention_phases.csv](attention_phases.csv)"]
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
                  label=f"{algorithm} predicted (per phase)")
        ax_t.plot(n, [float(r["roofline_s"]) for r in sel], ":", color=colors[algorithm],
                  label=f"{algorithm} roofline")
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
    ax_t.set(yscale="log", ylabel="time per call (s)", title="time: measured vs predicted")
    ax_s.set(ylabel="speedup of flash over standard (×)", title="speedup: measured vs predicted")
    ax_m.set(yscale="log", ylabel="peak memory during the call (MiB)", title="memory: S and P vs O(N·d)")
    for ax in (ax_t, ax_s, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (B=1, H=8, d=64, float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, png_path)
