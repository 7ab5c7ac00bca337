"""The LLM.int8() section: weight memory per model and precision, error against the outlier threshold, and the
decode GEMV measured on this machine beside the cost model's predicted speedup."""
from __future__ import annotations

import numpy as np

from kernels.int8 import Int8Linear, naive_absmax_matmul
from models import PRESETS, weight_bytes

from .. import costs
from ..costs import phases
from ..measure import streamed_gemv_seconds, time_call
from .charts import figure, save
from .core import RunContext, Section, planned, read_csv, write_csv
from .measured import error_pct, fresh_rates, streamed_buffer

PRECISIONS = ("fp32", "fp16", "int8", "int4")
THRESHOLDS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 40.0, 80.0)
N_OUTLIERS = 4


def planted_inputs(rng, m, k, n):
    """Activations x (m, k) with N_OUTLIERS hidden dimensions of magnitude 20-60 (the emergent features of LLM.int8()
    §4), and a weight w (n, k) = (out, in)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    cols = rng.choice(k, N_OUTLIERS, replace=False)
    x[:, cols] = (rng.uniform(20, 60, (m, N_OUTLIERS)) * rng.choice([-1, 1], (m, N_OUTLIERS))).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # (out, in)
    return x, w


GEMV_SIZES = {True: (2048, 4096), False: (1024, 2048, 4096, 8192)}  # keyed by quick: the quick report keeps one
# size on the calling thread (2048²) and one on the pool (4096²), within its minute (1024² took 3 of 60 s)


@planned(lambda quick: 2 + len(GEMV_SIZES[quick]))  # weight memory, error vs threshold, one per GEMV size
def int8_section(ctx: RunContext) -> Section:
    ctx.step("int8: weight memory")
    mem_rows = [{"model": name, "precision": p, "weight_bytes": weight_bytes(cfg, p)}
                for name, cfg in PRESETS.items() for p in PRECISIONS]
    write_csv(ctx.directory / "int8_weight_memory.csv", mem_rows)

    ctx.step("int8: error vs threshold")
    rng = np.random.default_rng(ctx.seed)
    x, w = planted_inputs(rng, 16, 4096, 256)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = float(np.abs(exact).mean())
    err_rows = []
    layer = Int8Linear.from_float(w)
    for t in THRESHOLDS:
        layer.threshold = t
        y, outlier_dims = layer(x, return_outliers=True)
        err_rows.append({"threshold": t, "outlier_dims": int(outlier_dims.size),
                         "mean_rel_error": f"{np.abs(y - exact).mean() / scale:.4g}"})
    naive = float(np.abs(naive_absmax_matmul(x, w) - exact).mean() / scale)
    fp16 = float(np.abs(x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
                        - exact).mean() / scale)
    for row in err_rows:
        row.update(naive_mean_rel_error=f"{naive:.4g}", fp16_mean_rel_error=f"{fp16:.4g}")
    write_csv(ctx.directory / "int8_error.csv", err_rows)

    gemv_rows = []
    rates = fresh_rates(ctx)
    for k in GEMV_SIZES[ctx.quick]:
        ctx.step(f"int8: GEMV {k}x{k}")
        x1, w1 = planted_inputs(rng, 1, k, k)
        int8_layer = Int8Linear.from_float(w1)
        t_int8 = time_call(lambda layer=int8_layer, x=x1: layer(x), repeats=15, warmup=3).median_s
        t_fp32 = time_call(lambda x=x1, w=w1: x @ w.T, repeats=15, warmup=3).median_s
        dense = costs.dense(1, k, k, elem_bytes=4, flop_kind="fp32").time(ctx.cpu).seconds
        split = costs.int8_split(1, k, k, N_OUTLIERS, elem_bytes=4).time(ctx.cpu).seconds
        p_fp32 = phases.total_seconds(phases.dense_gemv_phases(rates, k, k))
        p_int8 = phases.total_seconds(phases.int8_gemv_phases(rates, k, k, N_OUTLIERS))
        s_fp32, s_int8 = streamed_gemv_seconds(streamed_buffer(ctx, k), k, x1)  # as decode: another layer each
        q_fp32 = phases.total_seconds(phases.dense_gemv_phases(rates, k, k, resident=False))
        q_int8 = phases.total_seconds(phases.int8_gemv_phases(rates, k, k, N_OUTLIERS, resident=False))
        gemv_rows.append({"in_features": k, "out_features": k, "int8_measured_s": f"{t_int8:.6g}",
                          "fp32_measured_s": f"{t_fp32:.6g}",
                          "int8_predicted_s": f"{p_int8:.6g}", "fp32_predicted_s": f"{p_fp32:.6g}",
                          "measured_speedup": f"{t_fp32 / t_int8:.4g}",
                          "predicted_speedup": f"{p_fp32 / p_int8:.4g}",
                          "error_pct": f"{error_pct(p_fp32 / p_int8, t_fp32 / t_int8):.1f}",
                          "streamed_int8_measured_s": f"{s_int8:.6g}", "streamed_fp32_measured_s": f"{s_fp32:.6g}",
                          "streamed_int8_predicted_s": f"{q_int8:.6g}",
                          "streamed_fp32_predicted_s": f"{q_fp32:.6g}",
                          "streamed_measured_speedup": f"{s_fp32 / s_int8:.4g}",
                          "streamed_predicted_speedup": f"{q_fp32 / q_int8:.4g}",
                          "streamed_error_pct": f"{error_pct(q_fp32 / q_int8, s_fp32 / s_int8):.1f}",
                          "roofline_speedup": f"{float(dense) / float(split):.4g}",
                          "fp32_weight_bytes": 4 * k * k, "int8_weight_bytes": int8_layer.weight.nbytes})
    write_csv(ctx.directory / "int8_gemv.csv", gemv_rows)
    plot_int8(ctx.directory, float(ctx.cpu.l2_bytes))

    by = {(r["model"], r["precision"]): r["weight_bytes"] for r in mem_rows}
    best = min(err_rows, key=lambda r: float(r["mean_rel_error"]))
    default = next(r for r in err_rows if r["threshold"] == 6.0)
    off = err_rows[0]
    big = gemv_rows[-1]
    body = (
        f"LLM.int8() (Dettmers et al. 2022) stores linear weights as int8 with one float32 scale per output "
        f"feature, and routes the hidden dimensions where activations reach the threshold through float16.\n\n"
        f"**Weight memory.** Llama-3.1-70B needs {by[('llama-3.1-70b', 'fp32')] / 1e9:.0f} GB in fp32, "
        f"{by[('llama-3.1-70b', 'fp16')] / 1e9:.0f} GB in fp16 and {by[('llama-3.1-70b', 'int8')] / 1e9:.0f} GB "
        f"in int8 (embeddings and norms stay fp16); Llama-2-7B goes from {by[('llama-2-7b', 'fp32')] / 1e9:.1f} "
        f"to {by[('llama-2-7b', 'int8')] / 1e9:.1f} GB.\n\n![weight memory](int8_weight_memory.png)\n\n"
        f"**Error against the threshold** (16 × 4096 activations with {N_OUTLIERS} planted outlier dimensions "
        f"of magnitude 20-60, times a 4096 × 256 weight; mean |error| over mean |x·w|). Threshold 0 is plain "
        f"vector-wise int8: {float(off['mean_rel_error']):.3g}. At the paper's 6.0 the {default['outlier_dims']} "
        f"outlier dimensions go to float16 and the error drops to {float(default['mean_rel_error']):.3g}; "
        f"one scale for the whole tensor (naive) gives {naive:.3g}, float16 {fp16:.3g}. Lower thresholds send "
        f"more dimensions to float16 (at {best['threshold']:g}, {best['outlier_dims']} of 4096, error "
        f"{float(best['mean_rel_error']):.3g}), giving back the int8 saving for little accuracy; above the "
        f"outliers' magnitude nothing is routed and the error is plain int8's again.\n\n"
        f"![error vs threshold](int8_error.png)\n\n"
        f"**Decode GEMV on this machine** (one token, K = N, {N_OUTLIERS} outlier dimensions): int8 moves 4× "
        f"fewer weight bytes. Measured two ways: *streamed*, as a decode step meets its layers, one call after "
        f"another each on another layer's weights (copies filling twice the largest cache, so that every call "
        f"reads its weights from DRAM), and *resident*, the same layer called again and again (its weights in "
        f"whatever cache holds them). Streamed at {big['out_features']} × {big['in_features']}, the measured "
        f"speedup over NumPy's float32 GEMV is {float(big['streamed_measured_speedup']):.2f}× against "
        f"{float(big['streamed_predicted_speedup']):.2f}× predicted; resident "
        f"{float(big['measured_speedup']):.2f}× against {float(big['predicted_speedup']):.2f}× "
        f"({float(big['roofline_speedup']):.2f}× by the roofline on the calibrated spec). The "
        f"prediction times each side by what it runs: NumPy's float32 GEMV at the rate measured for it in this "
        f"run (its own BLAS on all cores, {rates.gemv_fp32_dram / 1e9:.1f} GB/s of weights from DRAM at K = "
        f"{phases.GEMV_K}, {rates.gemv_fp32_dram_wide / 1e9:.1f} at K = {phases.GEMV_WIDE_K}, "
        f"{rates.gemv_fp32_llc / 1e9:.1f} GB/s from the cache), the int8 path's weight bytes at the rate measured "
        f"for its own kernel on all cores ({rates.int8_gemv_dram / 1e9:.1f} GB/s from DRAM, "
        f"{rates.int8_gemv_llc / 1e9:.1f} from the cache) plus its fixed cost per call measured on a tiny vector "
        f"({rates.int8_call_s * 1e6:.0f} µs: outlier scan, quantization), each output's float16 products of "
        f"the outlier features ({rates.int8_outlier_s * 1e9:.1f} ns per output and feature on a thread) and, "
        f"from 2^24 multiply-adds on, one "
        f"parallel region's launch; a smaller product runs on the calling thread (`kernels._common.threads`), "
        f"at the kernel's one-thread rate from the cache ({rates.int8_gemv_one_llc / 1e9:.1f} GB/s) and "
        f"its DRAM rate ({rates.int8_gemv_one_dram / 1e9:.1f}). Streamed, every call runs at the DRAM rates; "
        f"resident, small weights fit in the last-level cache (dotted line), where float32 is not DRAM-bound and "
        f"the int8 path's fixed cost is not hidden.\n\n"
        f"| K = N | | fp32 µs | predicted | int8 µs | predicted | measured speedup | predicted speedup | error | "
        f"roofline speedup |\n|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(
            f"| {r['in_features']} | {label} | {float(r[pre + 'fp32_measured_s']) * 1e6:.0f} | "
            f"{float(r[pre + 'fp32_predicted_s']) * 1e6:.0f} | {float(r[pre + 'int8_measured_s']) * 1e6:.0f} | "
            f"{float(r[pre + 'int8_predicted_s']) * 1e6:.0f} | {float(r[pre + 'measured_speedup']):.2f}× | "
            f"{float(r[pre + 'predicted_speedup']):.2f}× | {float(r[pre + 'error_pct']):+.0f}% | "
            f"{float(r['roofline_speedup']):.2f}× |"
            for r in gemv_rows for label, pre in (("streamed", "streamed_"), ("resident", ""))) + "\n\n"
        "![GEMV speedup](int8_gemv.png)\n\n"
        f"Data: [int8_weight_memory.csv](int8_weight_memory.csv), [int8_error.csv](int8_error.csv), "
        f"[int8_gemv.csv](int8_gemv.csv)\n")
    files = ("int8_weight_memory.csv", "int8_weight_memory.png", "int8_error.csv", "int8_error.png",
             "int8_gemv.csv", "int8_gemv.png")
    return Section("LLM.int8(): memory, error, speed", body, files)


def plot_int8(directory, llc_bytes) -> None:
    rows = read_csv(directory / "int8_weight_memory.csv")
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure(width=9.0, height=4.4)
    ax = axes[0][0]
    width = 0.2
    colors = {"fp32": "tab:red", "fp16": "tab:orange", "int8": "tab:blue", "int4": "tab:green"}
    for i, p in enumerate(PRECISIONS):
        values = [int(next(r for r in rows if r["model"] == m and r["precision"] == p)["weight_bytes"]) / 1e9
                  for m in models]
        ax.bar(np.arange(len(models)) + (i - 1.5) * width, values, width, label=p, color=colors[p])
    ax.set_xticks(range(len(models)), models)
    ax.set(yscale="log", ylabel="weight memory (GB, log scale)", title="Weight memory by precision")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    save(fig, directory / "int8_weight_memory.png")

    rows = read_csv(directory / "int8_error.csv")
    fig, axes = figure(width=7.0, height=4.4)
    ax = axes[0][0]
    t = [float(r["threshold"]) for r in rows]
    ax.plot(t, [float(r["mean_rel_error"]) for r in rows], "-o", color="tab:blue", label="LLM.int8()")
    for i, r in enumerate(rows):
        ax.annotate(r["outlier_dims"], (t[i], float(r["mean_rel_error"])), textcoords="offset points",
                    xytext=(0, 6), fontsize=7, ha="center")
    ax.axhline(float(rows[0]["naive_mean_rel_error"]), color="tab:red", linestyle="--", label="naive per-tensor int8")
    ax.axhline(float(rows[0]["fp16_mean_rel_error"]), color="tab:gray", linestyle=":", label="float16")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(-0.2, THRESHOLDS[-1] * 1.3)
    ax.set(yscale="log", xlabel="outlier threshold (0 = plain vector-wise int8; labels: dims "
           "in float16)", ylabel="mean |error| / mean |x·w|", title="Error against the outlier threshold")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, directory / "int8_error.png")

    rows = read_csv(directory / "int8_gemv.csv")
    fig, axes = figure(width=7.0, height=4.4)
    ax = axes[0][0]
    k = [int(r["in_features"]) for r in rows]
    ax.plot(k, [float(r["streamed_measured_speedup"]) for r in rows], "-o", color="tab:purple",
            label="streamed (as in decode): measured")
    ax.plot(k, [float(r["streamed_predicted_speedup"]) for r in rows], "--", color="tab:purple",
            label="streamed: predicted (per phase)")
    ax.plot(k, [float(r["measured_speedup"]) for r in rows], "-o", color="tab:blue", label="resident: measured")
    ax.plot(k, [float(r["predicted_speedup"]) for r in rows], "--", color="tab:blue",
            label="resident: predicted (per phase)")
    ax.plot(k, [float(r["roofline_speedup"]) for r in rows], ":", color="tab:blue", label="roofline")
    ax.axhline(1.0, color="black", linewidth=0.8, label="float32 (baseline)")
    if llc_bytes:
        ax.axvline(np.sqrt(llc_bytes / 4), color="grey", linestyle=":", label="float32 weights fill the LLC")
    ax.set(xscale="log", xlabel="K = N (one token, K × N weights)", ylabel="speedup over NumPy float32 (×)",
           title="Decode GEMV: int8 vs float32 on this CPU")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, directory / "int8_gemv.png")
