"""Sections predicted by the cost model (deterministic): bytes by tensor, the SRAM sweep, the roofline, and the
flash-over-standard prediction across every hardware preset."""
from __future__ import annotations

import numpy as np

from .. import costs, hardware as hw_module
from .charts import ALGO_COLORS, ALGO_LABELS, TENSOR_COLORS, figure, save
from .core import RunContext, Section, planned, read_csv, write_csv

HEADS, D = 16, 64
ALGORITHMS = {"standard": costs.standard_forward, "flash1": costs.flash1_forward, "flash2": costs.flash2_forward}
TENSORS = ("Q", "K", "V", "S", "P", "O", "stats")


def _elem_bytes(hw) -> int:
    """fp16 on a GPU, float32 on the CPU (the precisions the kernels run in)."""
    return 2 if hw.kind == "gpu" else 4


def _gb(x) -> str:
    return f"{float(x) / 1e9:.3g} GB"


def _tensor_bytes(cost, tensor):
    """Bytes read plus written of one tensor; 'stats' gathers l, m and lse."""
    names = ("l", "m", "lse") if tensor == "stats" else (tensor,)
    return sum(int(cost.reads.get(t, 0)) + int(cost.writes.get(t, 0)) for t in names)


@planned(lambda quick: 2)  # the GPU preset and this CPU
def bytes_by_tensor_section(ctx: RunContext) -> Section:
    """HBM bytes of standard, FlashAttention-1 and -2, stacked by tensor, vs N, for the chosen preset and this CPU."""
    sizes = (1024, 4096, 16384) if ctx.quick else (1024, 4096, 16384, 65536)
    machines = [ctx.hardware] + ([ctx.cpu] if ctx.cpu is not None else [])
    rows = []
    for hw in machines:
        ctx.step(f"bytes by tensor on {hw.name}")
        for n in sizes:
            for algorithm, model in ALGORITHMS.items():
                cost = model(1, HEADS, HEADS, n, n, D, elem_bytes=_elem_bytes(hw), sram_bytes=hw.sram_per_sm_bytes)
                for tensor in TENSORS:
                    rows.append({"hardware": hw.name, "algorithm": algorithm, "n": n, "tensor": tensor,
                                 "hbm_bytes": _tensor_bytes(cost, tensor), "Br": int(cost.params["Br"]),
                                 "Bc": int(cost.params["Bc"])})
    write_csv(ctx.directory / "bytes_by_tensor.csv", rows)
    plot_bytes_by_tensor(ctx.directory / "bytes_by_tensor.csv", ctx.directory / "bytes_by_tensor.png")
    n = sizes[-1]
    total = {(r["hardware"], r["algorithm"]): 0 for r in rows}
    for r in rows:
        if r["n"] == n:
            total[(r["hardware"], r["algorithm"])] += r["hbm_bytes"]
    gpu = ctx.hardware.name
    std, fa1, fa2 = (total[(gpu, a)] for a in ("standard", "flash1", "flash2"))
    sp = [r["hbm_bytes"] for r in rows if r["hardware"] == gpu and r["n"] == n and r["algorithm"] == "standard"
          and r["tensor"] in ("S", "P")]
    body = (f"Bytes each algorithm moves between HBM and the chip, for one layer's attention forward (batch 1, "
            f"{HEADS} heads, d = {D}; fp16 on {gpu}, float32 on the CPU), with the tile sizes of FlashAttention's "
            f"rule for each machine's SRAM (the standard algorithm's matmuls with square GEMM tiles). At "
            f"N = {n} on {gpu} the standard algorithm moves {_gb(std)}, "
            f"{100 * sum(sp) / std:.0f}% of it S and P; FlashAttention-1 moves {_gb(fa1)} (Q and O re-read once "
            f"per K/V tile) and FlashAttention-2 {_gb(fa2)} (K and V re-read once per query block), "
            f"{std / fa2:.1f}× less than standard.\n\n"
            "![HBM bytes by tensor](bytes_by_tensor.png)\n\nData: [bytes_by_tensor.csv](bytes_by_tensor.csv)\n")
    return Section("Bytes moved, by tensor", body, ("bytes_by_tensor.csv", "bytes_by_tensor.png"))


def plot_bytes_by_tensor(csv_path, png_path) -> None:
    rows = read_csv(csv_path)
    machines = list(dict.fromkeys(r["hardware"] for r in rows))
    sizes = sorted({int(r["n"]) for r in rows})
    fig, axes = figure(ncols=len(sizes), nrows=len(machines), width=3.6, height=3.4)
    for mi, machine in enumerate(machines):
        for ni, n in enumerate(sizes):
            ax = axes[mi][ni]
            for ai, algorithm in enumerate(ALGORITHMS):
                bottom = 0.0
                for tensor in TENSORS:
                    value = sum(int(r["hbm_bytes"]) for r in rows if r["hardware"] == machine and int(r["n"]) == n
                                and r["algorithm"] == algorithm and r["tensor"] == tensor) / 1e9
                    ax.bar(ai, value, bottom=bottom, color=TENSOR_COLORS[tensor],
                           label=tensor if (mi, ni, ai) == (0, 0, 0) else None)
                    bottom += value
            ax.set_xticks(range(len(ALGORITHMS)), ["standard", "FA-1", "FA-2"])
            ax.set_title(f"{machine.split(' (')[0]}, N = {n}", fontsize=9)
            ax.set_ylabel("HBM bytes read + written (GB)" if ni == 0 else "")
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Bytes moved per attention forward, stacked by tensor (linear scale per panel)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.legend(loc="lower center", ncol=len(TENSORS), fontsize=9, title="tensor")
    save(fig, png_path)


SRAM_KIB = (16, 32, 64, 96, 128, 164, 228, 256)
BLOCK_ROWS = (8, 16, 32, 64, 128, 256)


@planned(lambda quick: 1)
def sram_sweep_section(ctx: RunContext) -> Section:
    """Bytes and predicted time vs SRAM size (tiles from the paper's rule) and vs the FA-2 query block size."""
    hw = ctx.hardware
    ctx.step(f"SRAM sweep on {hw.name}")
    n = 4096 if ctx.quick else 16384
    e = _elem_bytes(hw)
    m = np.array(SRAM_KIB) * 1024
    rows = []
    for algorithm, model in ALGORITHMS.items():
        cost = model(1, HEADS, HEADS, n, n, D, elem_bytes=e, sram_bytes=m)
        seconds = cost.time(hw).seconds
        for i, kib in enumerate(SRAM_KIB):
            rows.append({"sweep": "sram", "algorithm": algorithm, "sram_kib": kib, "Br": int(cost.params["Br"][i]),
                         "Bc": int(cost.params["Bc"][i]), "hbm_bytes": int(cost.hbm_bytes[i]),
                         "predicted_s": f"{float(seconds[i]):.6g}", "fits": True})
    bc = int(costs.flash_tiles(D, e, hw.sram_per_sm_bytes, keep="rows")[1])
    for br in BLOCK_ROWS:
        cost = costs.flash2_forward(1, HEADS, HEADS, n, n, D, elem_bytes=e, Br=br, Bc=bc)
        fits = bool(cost.sram_peak_bytes <= hw.sram_per_sm_bytes)
        rows.append({"sweep": "block", "algorithm": "flash2", "sram_kib": round(hw.sram_per_sm_bytes / 1024),
                     "Br": br, "Bc": bc, "hbm_bytes": int(cost.hbm_bytes),
                     "predicted_s": f"{float(cost.time(hw).seconds):.6g}", "fits": fits})
    write_csv(ctx.directory / "sram_sweep.csv", rows)
    plot_sram_sweep(ctx.directory / "sram_sweep.csv", ctx.directory / "sram_sweep.png", hw.name, n)
    fa2 = {r["sram_kib"]: r for r in rows if r["sweep"] == "sram" and r["algorithm"] == "flash2"}
    fa1 = {r["sram_kib"]: r for r in rows if r["sweep"] == "sram" and r["algorithm"] == "flash1"}
    std = {r["sram_kib"]: r for r in rows if r["sweep"] == "sram" and r["algorithm"] == "standard"}
    lo, hi = SRAM_KIB[0], SRAM_KIB[-1]
    body = (f"{hw.name}, N = {n}, {HEADS} heads, d = {D}. Left and middle: the SRAM per SM varies and the tiles "
            f"follow FlashAttention's rule (Bc = ⌈M/4d⌉, Br = min(Bc, d), halved until they fit). From {lo} to "
            f"{hi} KiB, FlashAttention-1's bytes fall from {_gb(fa1[lo]['hbm_bytes'])} to "
            f"{_gb(fa1[hi]['hbm_bytes'])} (Q and O re-read N/Bc times) and FlashAttention-2's from "
            f"{_gb(fa2[lo]['hbm_bytes'])} to {_gb(fa2[hi]['hbm_bytes'])} (it stops improving once the rule's "
            f"Br reaches its cap, d = {D}: K and V are re-read N/Br times); the standard algorithm's bytes change "
            f"only through its matmul tiles ({_gb(std[lo]['hbm_bytes'])} at {lo} KiB, "
            f"{_gb(std[hi]['hbm_bytes'])} at {hi} KiB), since S and P do not depend on the SRAM. Right: "
            f"FlashAttention-2 at this part's "
            f"{round(hw.sram_per_sm_bytes / 1024)} KiB with Bc = {bc} and a growing query block Br (hollow "
            f"markers: the tiles no longer fit in SRAM): K and V are re-read N/Br times, so taller query blocks "
            f"move fewer bytes.\n\n![SRAM sweep](sram_sweep.png)\n\nData: [sram_sweep.csv](sram_sweep.csv)\n")
    return Section("SRAM size and block size", body, ("sram_sweep.csv", "sram_sweep.png"))


def plot_sram_sweep(csv_path, png_path, hw_name, n) -> None:
    rows = read_csv(csv_path)
    fig, axes = figure(ncols=3, width=4.6)
    ax_b, ax_t, ax_k = axes[0]
    for algorithm in ALGORITHMS:
        sel = [r for r in rows if r["sweep"] == "sram" and r["algorithm"] == algorithm]
        kib = [int(r["sram_kib"]) for r in sel]
        style = dict(color=ALGO_COLORS[algorithm], marker="o", label=ALGO_LABELS[algorithm])
        ax_b.plot(kib, [int(r["hbm_bytes"]) / 1e9 for r in sel], **style)
        ax_t.plot(kib, [float(r["predicted_s"]) * 1e3 for r in sel], **style)
    block = [r for r in rows if r["sweep"] == "block"]
    for r in block:
        ax_k.plot(int(r["Br"]), int(r["hbm_bytes"]) / 1e9, "o", color=ALGO_COLORS["flash2"],
                  fillstyle="full" if r["fits"] == "True" else "none")
    ax_k.plot([int(r["Br"]) for r in block], [int(r["hbm_bytes"]) / 1e9 for r in block], color=ALGO_COLORS["flash2"],
              label="FlashAttention-2")
    std = next(r for r in rows if r["sweep"] == "sram" and r["algorithm"] == "standard")
    ax_k.axhline(int(std["hbm_bytes"]) / 1e9, color=ALGO_COLORS["standard"], linestyle="--", label="standard")
    for ax in (ax_b, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("SRAM per SM (KiB)")
    ax_b.set(yscale="log", ylabel="HBM bytes (GB)", title=f"bytes vs SRAM ({hw_name}, N={n})")
    ax_t.set(yscale="log", ylabel="predicted time (ms)", title="roofline time vs SRAM")
    ax_k.set(xscale="log", yscale="log", xlabel="query block rows Br", ylabel="HBM bytes (GB)",
             title="FlashAttention-2 bytes vs Br")
    ax_k.set_xscale("log", base=2)
    for ax in (ax_b, ax_t, ax_k):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, png_path)


@planned(lambda quick: 1)
def roofline_section(ctx: RunContext) -> Section:
    """The roofline of the chosen hardware with each algorithm's (arithmetic intensity, attained FLOP/s) point."""
    hw = ctx.hardware
    ctx.step(f"roofline of {hw.name}")
    e = _elem_bytes(hw)
    n = 4096
    points = {name: model(1, HEADS, HEADS, n, n, D, elem_bytes=e, sram_bytes=hw.sram_per_sm_bytes)
              for name, model in ALGORITHMS.items()}
    points["decode (N=4096 cache)"] = costs.decode(1, HEADS, HEADS, n, D, elem_bytes=e,
                                                   sram_bytes=hw.sram_per_sm_bytes)
    points["GEMV 1×4096×4096"] = costs.dense(1, 4096, 4096, elem_bytes=e)
    points["GEMM 4096³"] = costs.dense(4096, 4096, 4096, elem_bytes=e)
    rows = []
    for name, cost in points.items():
        seconds = float(cost.time(hw).seconds)
        rows.append({"point": name, "flops": int(cost.flops), "hbm_bytes": int(cost.hbm_bytes),
                     "intensity_flop_per_byte": f"{float(cost.flops) / float(cost.hbm_bytes):.4g}",
                     "predicted_s": f"{seconds:.6g}", "attained_tflops": f"{float(cost.flops) / seconds / 1e12:.4g}"})
    write_csv(ctx.directory / "roofline.csv", rows)
    plot_roofline(ctx.directory / "roofline.csv", ctx.directory / "roofline.png", hw)
    by = {r["point"]: r for r in rows}
    ridge = hw.ridge_point("fp16")
    body = (f"{hw.name}: attainable FLOP/s = min(peak, bandwidth × intensity) (Williams, Waterman & Patterson "
            f"2009); the fp16 tensor-core roof turns at {ridge:.0f} FLOP/byte. Attention at N = {n}, {HEADS} heads, "
            f"d = {D}: the standard algorithm's intensity is {float(by['standard']['intensity_flop_per_byte']):.0f} "
            f"FLOP/byte, under the ridge, so it is bandwidth-bound; FlashAttention-2 reaches "
            f"{float(by['flash2']['intensity_flop_per_byte']):.0f}. A decode step "
            f"({float(by['decode (N=4096 cache)']['intensity_flop_per_byte']):.1f} FLOP/byte) and a batch-1 GEMV "
            f"({float(by['GEMV 1×4096×4096']['intensity_flop_per_byte']):.1f}) sit far left: only fewer bytes "
            f"(int8 weights, a pruned KV cache) make them faster.\n\n![roofline](roofline.png)\n\n"
            f"Data: [roofline.csv](roofline.csv)\n")
    return Section(f"Roofline of {hw.name}", body, ("roofline.csv", "roofline.png"))


def plot_roofline(csv_path, png_path, hw) -> None:
    rows = read_csv(csv_path)
    fig, axes = figure(width=7.5, height=4.8)
    ax = axes[0][0]
    intensity = np.logspace(-1, 4, 200)
    for kind, style in (("fp16", "-"), ("fp32", ":")):
        if hw.peak(kind) > 0:
            ax.plot(intensity, np.minimum(hw.peak(kind), hw.hbm_bandwidth * intensity) / 1e12, style, color="black",
                    label=f"{kind} roof ({hw.peak(kind) / 1e12:.0f} TFLOP/s, {hw.hbm_bandwidth / 1e9:.0f} GB/s)")
    markers = iter("osD^v<>p")
    for r in rows:
        color = ALGO_COLORS.get(r["point"], "tab:gray")
        ax.plot(float(r["intensity_flop_per_byte"]), float(r["attained_tflops"]), next(markers), color=color,
                markersize=8, label=ALGO_LABELS.get(r["point"], r["point"]))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per HBM byte)",
           ylabel="attainable TFLOP/s", title=f"Roofline of {hw.name} (predicted points)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    save(fig, png_path)


ACROSS_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def across_hardware_rows():
    """Predicted flash-2-over-standard speedup and bytes ratio for every preset (deterministic: the golden CSV)."""
    n = np.array(ACROSS_SIZES)
    rows = []
    for name in hw_module.preset_names():
        hw = hw_module.load(name)
        std = costs.standard_forward(1, HEADS, HEADS, n, n, D, elem_bytes=2, sram_bytes=hw.sram_per_sm_bytes)
        fa2 = costs.flash2_forward(1, HEADS, HEADS, n, n, D, elem_bytes=2, sram_bytes=hw.sram_per_sm_bytes)
        t_std, t_fa2 = std.time(hw).seconds, fa2.time(hw).seconds
        for i, size in enumerate(ACROSS_SIZES):
            rows.append({"hardware": name, "n": size, "standard_hbm_bytes": int(std.hbm_bytes[i]),
                         "flash2_hbm_bytes": int(fa2.hbm_bytes[i]),
                         "bytes_ratio": f"{std.hbm_bytes[i] / fa2.hbm_bytes[i]:.4g}",
                         "standard_predicted_s": f"{t_std[i]:.6g}",
                         "flash2_predicted_s": f"{t_fa2[i]:.6g}",
                         "predicted_speedup": f"{t_std[i] / t_fa2[i]:.4g}"})
    return rows


@planned(lambda quick: 1)
def across_hardware_section(ctx: RunContext) -> Section:
    ctx.step("across hardware")
    rows = across_hardware_rows()
    write_csv(ctx.directory / "across_hardware.csv", rows)
    plot_across_hardware(ctx.directory / "across_hardware.csv", ctx.directory / "across_hardware.png")
    at = {r["hardware"]: r for r in rows if r["n"] == 16384}
    best = max(at.values(), key=lambda r: float(r["predicted_speedup"]))
    worst = min(at.values(), key=lambda r: float(r["predicted_speedup"]))
    body = (f"Every preset, batch 1, {HEADS} heads, d = {D}, fp16, no mask; tiles from each part's SRAM. At "
            f"N = 16384 the predicted speedup of FlashAttention-2 over standard ranges from "
            f"{float(worst['predicted_speedup']):.1f}× ({worst['hardware']}) to "
            f"{float(best['predicted_speedup']):.1f}× ({best['hardware']}). Both sides are memory-bound here, so "
            f"the speedup tracks the bytes ratio. FlashAttention-2's bytes barely depend on the part (the tile "
            f"rule caps Br at d = {D} on every SRAM here), while the standard algorithm's matmul tiles shrink with "
            f"the SRAM, so the part with the least SRAM shows the largest ratio. The step at long N is where a "
            f"float32 row of S no longer fits in SRAM and the softmax reads S twice.\n\n"
            f"![across hardware](across_hardware.png)\n\nData: [across_hardware.csv](across_hardware.csv)\n")
    return Section("Across hardware", body, ("across_hardware.csv", "across_hardware.png"))


def plot_across_hardware(csv_path, png_path) -> None:
    rows = read_csv(csv_path)
    fig, axes = figure(ncols=2, width=6.0)
    ax_s, ax_b = axes[0]
    for name in dict.fromkeys(r["hardware"] for r in rows):
        sel = [r for r in rows if r["hardware"] == name]
        n = [int(r["n"]) for r in sel]
        ax_s.plot(n, [float(r["predicted_speedup"]) for r in sel], "-o", markersize=3, label=name)
        ax_b.plot(n, [float(r["bytes_ratio"]) for r in sel], "-o", markersize=3, label=name)
    for ax, ylabel, title in ((ax_s, "predicted speedup, FA-2 over standard (×)", "predicted speedup"),
                              (ax_b, "HBM bytes, standard / FA-2 (×)", "bytes saved")):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=ylabel, title=title)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, png_path)
