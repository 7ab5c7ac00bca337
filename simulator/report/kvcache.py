"""The SnapKV section: KV-cache memory against context length per model, with pruning budgets, and a decode step
over a full and a pruned cache measured on this machine beside the cost model's prediction."""
from __future__ import annotations


import numpy as np

from kernels.cpuinfo import cache_sizes
from kernels.kvprune import snapkv_compress
from models import get_config, kv_cache_bytes

from kernels.attn import default_blocks

from .. import costs
from ..costs import phases
from ..measure import decode_seconds
from .charts import figure, save
from .core import RunContext, Section, planned, read_csv, write_csv
from .measured import dram_buffer, error_pct, fresh_rates

MODELS = ("smollm2-135m", "llama-2-7b", "llama-3.1-8b", "llama-3.1-70b")
CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
BUDGETS = (1024, 4096)
HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention layout


DECODE_SIZES = {True: (4096, 8192), False: (4096, 16384, 65536)}  # keyed by quick


@planned(lambda quick: 1 + len(DECODE_SIZES[quick]))  # cache memory, one per decode size
def kvcache_section(ctx: RunContext) -> Section:
    ctx.step("KV cache memory")
    mem_rows = []
    for name in MODELS:
        cfg = get_config(name)
        for n in CONTEXTS:
            mem_rows.append({"model": name, "n": n, "full_bytes": kv_cache_bytes(cfg, n),
                             **{f"capacity_{c}_bytes": kv_cache_bytes(cfg, min(n, c)) for c in BUDGETS}})
    write_csv(ctx.directory / "kv_cache_memory.csv", mem_rows)

    capacity = 1024
    rates = fresh_rates(ctx)
    _, bc = default_blocks(D, 4, HQ // HKV)  # the flash kernel's key block (decode: Br = 1)
    llc = cache_sizes().get("L3", 32 * 2**20)
    rng = np.random.default_rng(ctx.seed)
    rows = []
    for n in DECODE_SIZES[ctx.quick]:
        ctx.step(f"decode full vs pruned, N={n}")
        q = rng.standard_normal((1, HQ, n, D), dtype=np.float32)
        k, v = (rng.standard_normal((1, HKV, n, D), dtype=np.float32) for _ in range(2))
        k_c, v_c, _ = snapkv_compress(q, k, v, capacity=capacity)
        # each side cycles through enough caches to exceed the last-level cache twice: a model's layers each
        # have their own, so K and V come from DRAM. After the real one, the caches are views of the run's DRAM
        # buffer, not hundreds of copies made and filled for each size (16 s of the quick report where the OS
        # reports a 480 MiB L3)
        for label, (kk, vv) in (("full", (k, v)), ("snapkv", (k_c, v_c))):
            t = decode_seconds(dram_buffer(ctx), q[:, :, -1:], kk, vv, llc)
            kept = n if label == "full" else capacity
            cost = costs.decode(1, HQ, HKV, n, D, elem_bytes=4, capacity=None if label == "full" else capacity,
                                Bc=bc)
            predicted = phases.total_seconds(phases.decode_phases(rates, 1, HQ, HKV, kept, D, Bc=bc))
            rows.append({"n": n, "cache": label, "kept_tokens": kept,
                         "measured_s": f"{t:.6g}", "predicted_s": f"{predicted:.6g}",
                         "error_pct": f"{error_pct(predicted, t):.1f}",
                         "roofline_s": f"{float(cost.time(ctx.cpu).seconds):.6g}",
                         "hbm_bytes": int(cost.hbm_bytes)})
    write_csv(ctx.directory / "kv_decode.csv", rows)
    plot_kvcache(ctx.directory)

    by = {(r["model"], r["n"]): r for r in mem_rows}
    l70 = by[("llama-3.1-70b", 131072)]
    l2 = by[("llama-2-7b", 32768)]
    timing = {(int(r["n"]), r["cache"]): r for r in rows}
    n_big = DECODE_SIZES[ctx.quick][-1]
    full_t = float(timing[(n_big, "full")]["measured_s"])
    pruned_t = float(timing[(n_big, "snapkv")]["measured_s"])
    pred = float(timing[(n_big, "full")]["predicted_s"]) / float(timing[(n_big, "snapkv")]["predicted_s"])
    table = "\n".join(
        f"| {r['n']} | {r['cache']} | {r['kept_tokens']} | {float(r['measured_s']) * 1e6:.0f} | "
        f"{float(r['predicted_s']) * 1e6:.0f} | {float(r['error_pct']):+.0f}% | {float(r['roofline_s']) * 1e6:.0f} |"
        for r in rows)
    ratio_lines = []
    for n in DECODE_SIZES[ctx.quick]:
        full, pruned = timing[(n, "full")], timing[(n, "snapkv")]
        measured = float(full["measured_s"]) / float(pruned["measured_s"])
        predicted = float(full["predicted_s"]) / float(pruned["predicted_s"])
        ratio_lines.append(f"| {n} | {measured:.2f}× | {predicted:.2f}× | {error_pct(predicted, measured):+.0f}% |")
    ratios = "\n".join(ratio_lines)
    body = (
        f"SnapKV (Li et al. 2024) keeps, per kv head, the prompt positions its last 32 queries attend to most "
        f"(pooled), plus those 32; decoding then reads only the kept tokens.\n\n"
        f"**KV-cache memory** grows linearly with the context: 2 · layers · kv heads · head dim · 2 bytes per "
        f"token (fp16). Llama-3.1-70B holds {l70['full_bytes'] / 1e9:.0f} GB for one 128k-token sequence "
        f"(GQA: 8 kv heads for 64 query heads), Llama-2-7B (no GQA) {l2['full_bytes'] / 1e9:.1f} GB at 32k. "
        f"The dashed lines are the same models with the cache capped at a SnapKV budget of "
        f"{BUDGETS[0]} tokens, the dotted ones at {BUDGETS[1]}.\n\n![KV-cache memory](kv_cache_memory.png)\n\n"
        f"**Decode on this machine** ({HQ} query heads, {HKV} kv heads, d = {D}, float32, one new token): at "
        f"N = {n_big} the full cache takes {full_t * 1e6:.0f} µs and the {capacity}-token SnapKV cache "
        f"{pruned_t * 1e6:.0f} µs, {full_t / pruned_t:.1f}× faster against {pred:.1f}× predicted. The "
        f"prediction is the per-phase model: the kept K/V bytes at the rate a decode call (its skinny block "
        f"products: a GQA group's rows against a key block) streams them from DRAM, measured in this run "
        f"({rates.decode_stream / 1e9:.1f} GB/s on all threads over one large cache, "
        f"{rates.decode_stream_one / 1e9:.1f} on the calling thread over small caches met in turn, against "
        f"{rates.read_all / 1e9:.1f} GB/s for a plain read), plus the fixed cost of one `kernels.attention` call "
        f"measured on a tiny input "
        f"({rates.attention_call_s * 1e6:.0f} µs: validation and allocation) and, for a call on the pool, its "
        f"launches. A call under 2²⁴ multiply-adds (a cache under "
        f"{phases.SERIAL_MULTIPLY_ADDS // (2 * HQ * D)} tokens here) runs on the calling thread "
        f"(`kernels/_common/threads.py`), at the calling thread's rate; a pruned cache's read does not hide the fixed "
        f"cost, which is why the speedup is far below the bytes ratio. *Roofline* is `Cost.time` on the calibrated "
        f"spec.\n\n"
        f"| N | cache | kept tokens | measured µs | predicted µs | error | roofline µs |\n"
        f"|---|---|---|---|---|---|---|\n{table}\n\n"
        f"| N | measured speedup | predicted speedup | error |\n|---|---|---|---|\n{ratios}\n\n"
        f"![decode full vs pruned](kv_decode.png)\n\n"
        f"Data: [kv_cache_memory.csv](kv_cache_memory.csv), [kv_decode.csv](kv_decode.csv)\n")
    return Section("SnapKV: KV-cache memory and decode time", body,
                   ("kv_cache_memory.csv", "kv_cache_memory.png", "kv_decode.csv", "kv_decode.png"))


def plot_kvcache(directory) -> None:
    rows = read_csv(directory / "kv_cache_memory.csv")
    fig, axes = figure(width=7.5, height=4.8)
    ax = axes[0][0]
    colors = dict(zip(MODELS, ("tab:green", "tab:orange", "tab:blue", "tab:red")))
    for name in MODELS:
        sel = [r for r in rows if r["model"] == name]
        n = [int(r["n"]) for r in sel]
        ax.plot(n, [int(r["full_bytes"]) / 1e9 for r in sel], "-o", color=colors[name], label=f"{name} full")
        for c, style in zip(BUDGETS, ("--", ":")):
            ax.plot(n, [int(r[f"capacity_{c}_bytes"]) / 1e9 for r in sel], style, color=colors[name])
    ax.plot([], [], "k--", label=f"SnapKV budget {BUDGETS[0]} tokens")
    ax.plot([], [], "k:", label=f"SnapKV budget {BUDGETS[1]} tokens")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV cache per sequence (GB, fp16)",
           title="KV-cache memory vs context")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, directory / "kv_cache_memory.png")

    rows = read_csv(directory / "kv_decode.csv")
    fig, axes = figure(width=7.0, height=4.4)
    ax = axes[0][0]
    for cache, color in (("full", "tab:red"), ("snapkv", "tab:blue")):
        sel = [r for r in rows if r["cache"] == cache]
        n = [int(r["n"]) for r in sel]
        label = "full cache" if cache == "full" else "SnapKV, 1024 tokens"
        ax.plot(n, [float(r["measured_s"]) * 1e6 for r in sel], "-o", color=color, label=f"{label}, measured")
        ax.plot(n, [float(r["predicted_s"]) * 1e6 for r in sel], "--", color=color, label=f"{label}, predicted")
    ax.set(xscale="log", yscale="log", xlabel="prompt length N", ylabel="one decode step's attention (µs)",
           title="Decode over a full vs a SnapKV cache (this CPU)")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, directory / "kv_decode.png")
