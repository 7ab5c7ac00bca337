"""The one-call GPU check: ``python -m simulator gpu-check --out DIR`` (the issue asks for under 6 minutes on an
H200; not yet run on one).

1. Correctness at real sizes of both GPU tiers (Numba-CUDA and the CUDA C tensor-core kernels) against the float64
   oracles; float16/bfloat16 by flash-attn's rule (error <= 2 × the error of the same attention computed plainly
   in that precision, plus half an ulp of the output's scale); the int8 paths exactly against the CPU tier.
2. Benchmarks timed with CUDA events after warm-up, medians of repeats, inputs rotated through enough copies to
   exceed the L2 several times: both tiers, the standard baseline, torch's scaled_dot_product_attention
   (FlashAttention-2 backend), CuPy's float16 matmul, and bitsandbytes' int8 matmul when it is installed.
3. DRAM bytes of each kernel from Nsight Compute, beside the cost model's prediction for the H200 preset.
4. compute-sanitizer memcheck and racecheck on each CUDA C case at small sizes.
5. CSV, Markdown and one chart in DIR (seven files, so that all of them come back from a lent machine).

Each part that a machine cannot run (no ncu, counters refused, no torch, no bitsandbytes) is recorded with the
reason instead of failing the check; a failed correctness case makes the command exit with status 1.
"""
from __future__ import annotations

import csv
import datetime as _dt
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

L2_ROTATE_BYTES = 4 * 60 * 2**20  # rotate inputs past 4 × the H200's 60 MB of L2 (hardware-facts.md)


# -- 1. correctness ----------------------------------------------------------------------------------------------
def _round_bf16(x):
    """Round a float32 NumPy array to bfloat16 precision (round half to even), kept in float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    u = (u + (((u >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return u.view(np.float32)


def _plain_attention(q, k, v, causal, dtype):
    """Attention with every step rounded to ``dtype`` (float16 or bfloat16), on the host: the baseline of
    flash-attn's tolerance rule."""
    rnd = (lambda x: np.asarray(x, dtype=np.float16).astype(np.float32)) if dtype == "float16" else _round_bf16
    group = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = rnd(rnd(q @ np.swapaxes(kk, -1, -2)) * rnd(1 / np.sqrt(q.shape[-1])))  # (B, H, Nq, Nk)
    nq, nk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    p = rnd(np.exp(s - m))
    l = rnd(p.sum(axis=-1, keepdims=True))
    return rnd(rnd(p @ vv) / np.where(l == 0, 1, l))


def _judge(out, ref, dtype, plain=None):
    """(max abs error, bound, passed) against the oracle with the dtype's rule (the tolerance table of
    kernels/attn/_reference.py, which the tests use too)."""
    from kernels.tolerances import LOW_PRECISION_FACTOR, TOLERANCES, UNIT_ROUNDOFF

    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    err = float(np.abs(out - ref).max(initial=0.0))
    scale = float(np.abs(ref).max(initial=0.0))
    if dtype in UNIT_ROUNDOFF:
        plain_err = float(np.abs(plain - ref).max(initial=0.0))
        bound = LOW_PRECISION_FACTOR * plain_err + UNIT_ROUNDOFF[dtype] * scale
    else:
        bound = TOLERANCES[dtype]["atol"] + TOLERANCES[dtype]["rtol"] * scale
    return err, bound, bool(np.isfinite(out).all() and err <= bound)


def correctness(quick: bool, log) -> list[dict]:
    import cupy

    import kernels
    from kernels import int8, kvprune
    from kernels.attn import _cupy as tier2
    from kernels.attn import reference

    rng = np.random.default_rng(1)
    rows = []
    n = 512 if quick else 2048
    attention_cases = [  # (tier, algorithm, dtype, B, Hq, Hkv, Nq, Nk, d, causal)
        ("cupy", "flash", "float16", 1, 8, 2, n - 1, n - 1, 64, True),
        ("cupy", "flash", "bfloat16", 1, 8, 2, n - 1, n - 1, 64, True),
        ("cupy", "flash", "float16", 1, 4, 4, n, n, 128, False),
        ("cupy", "flash", "bfloat16", 1, 4, 4, n, n, 128, False),
        ("cupy", "flash", "float16", 2, 4, 1, 17, n // 2 + 3, 128, True),
        ("cupy", "flash", "float16", 1, 2, 2, 100, 40, 64, True),  # rows that see no key
        ("cupy", "standard", "float16", 1, 4, 2, n // 2, n // 2, 64, True),
        ("numba-cuda", "flash", "float32", 1, 4, 2, n // 2 + 5, n // 2 + 5, 64, True),
        ("numba-cuda", "flash", "float16", 1, 4, 4, n // 4, n // 2, 128, False),
        ("numba-cuda", "standard", "float32", 1, 2, 1, n // 4, n // 4, 64, True),
    ]
    for tier, algorithm, dtype, B, Hq, Hkv, Nq, Nk, d, causal in attention_cases:
        host = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
        q = rng.standard_normal((B, Hq, Nq, d)).astype(host)
        k = rng.standard_normal((B, Hkv, Nk, d)).astype(host)
        v = rng.standard_normal((B, Hkv, Nk, d)).astype(host)
        if dtype == "bfloat16":  # the oracle sees the same rounded inputs
            q, k, v = _round_bf16(q), _round_bf16(k), _round_bf16(v)
            bits = [tier2.to_bfloat16_bits(cupy.asarray(x)) for x in (q, k, v)]
            o_bits, _ = tier2.flash_forward(*bits, 1 / math.sqrt(d), causal, dtype="bfloat16")
            out = cupy.asnumpy(tier2.from_bfloat16_bits(o_bits))
        else:
            out = cupy.asnumpy(kernels.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal,
                                                 algorithm=algorithm, backend=tier))
        ref = reference(q, k, v, causal=causal)
        plain = _plain_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal,
                                 dtype) if dtype in ("float16", "bfloat16") else None
        err, bound, ok = _judge(out, ref, dtype, plain)
        rows.append({"tier": tier, "kernel": f"attention {algorithm}", "dtype": dtype,
                     "case": f"B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} causal={causal}",
                     "max_abs_error": f"{err:.3g}", "bound": f"{bound:.3g}", "passed": ok})
        log(f"correctness {rows[-1]['tier']} {rows[-1]['kernel']} {dtype} {rows[-1]['case']}: {ok}")

    # int8: the GPU tiers against the CPU tier (integer parts exact, so y agrees to float32 rounding)
    M, K, N = (128, 512, 256) if quick else (512, 2048, 1024)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, rng.choice(K, 5, replace=False)] *= 20.0
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    cpu = int8.int8_matmul(x, w, backend="cpu")
    for tier in ("cupy", "numba-cuda"):
        y = cupy.asnumpy(cupy.asarray(int8.int8_matmul(cupy.asarray(x), cupy.asarray(w), backend=tier)))
        err = float(np.abs(y - cpu).max())
        bound = 1e-6 * float(np.abs(cpu).max())
        rows.append({"tier": tier, "kernel": "int8 split matmul", "dtype": "float32 in, int8/int32 inside",
                     "case": f"M={M} K={K} N={N}, 5 outlier dims", "max_abs_error": f"{err:.3g}",
                     "bound": f"{bound:.3g} (CPU tier)", "passed": err <= bound})
    from kernels.int8 import _cupy as int8_tier2

    weight = int8.Int8Weight.from_float(w)
    x_i8 = rng.integers(-127, 128, (M, K), dtype=np.int8)
    exact = int8.int8_gemm(x_i8, weight.w_i8_t)
    w_t = cupy.zeros((N, int8_tier2.padded(K)), dtype=cupy.int8)
    w_t[:, :K] = cupy.asarray(weight.w_i8_t)
    x_p = cupy.zeros((M, int8_tier2.padded(K)), dtype=cupy.int8)
    x_p[:, :K] = cupy.asarray(x_i8)
    ones = cupy.ones(max(M, N), dtype=cupy.float32)
    _, c = int8_tier2.gemm(x_p, w_t, ones[:M], ones[:N], want_int32=True)
    same = bool(np.array_equal(cupy.asnumpy(c), exact))
    rows.append({"tier": "cupy", "kernel": "int8 GEMM (mma.sync s8)", "dtype": "int32", "case": f"M={M} K={K} N={N}",
                 "max_abs_error": "0" if same else "differs", "bound": "exact", "passed": same})

    # SnapKV: the kept positions against the float64 oracle
    Nq = 1024 if quick else 4096
    q = rng.standard_normal((1, 8, Nq, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, Nq, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, Nq, 64)).astype(np.float32)
    expected = kvprune.snapkv_kept_reference(q, k, capacity=256, window=32)
    for tier in ("cupy", "numba-cuda"):
        _, _, kept = kvprune.snapkv_compress(q, k, v, capacity=256, window=32, backend=tier)
        same = bool(np.array_equal(np.asarray(kept), expected))
        rows.append({"tier": tier, "kernel": "SnapKV kept positions", "dtype": "float32",
                     "case": f"Hq=8 Hkv=2 N={Nq} capacity=256", "max_abs_error": "0" if same else "differs",
                     "bound": "exact", "passed": same})
    for r in rows[-4:]:
        log(f"correctness {r['tier']} {r['kernel']}: {r['passed']}")
    return rows


# -- 2. benchmarks -----------------------------------------------------------------------------------------------
def _time(fn, sets, warmup=2, repeats=10):
    """Median seconds of fn(*set) over CUDA events, cycling through the input ``sets`` (none served from L2)."""
    import cupy

    for i in range(warmup):
        fn(*sets[i % len(sets)])
    cupy.cuda.Device().synchronize()
    times = []
    for i in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(*sets[i % len(sets)])
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def _sets(make, set_bytes):
    return [make(i) for i in range(max(2, math.ceil(L2_ROTATE_BYTES / max(set_bytes, 1))))]


def benchmarks(quick: bool, log) -> list[dict]:
    import cupy

    import kernels
    from kernels import int8

    rows = []
    B, H, N, d = (1, 8, 2048, 128) if quick else (4, 16, 8192, 128)

    def attn_sets(n, dtype=cupy.float16, b=B, h=H):
        nbytes = 3 * b * h * n * d * 2
        rs = cupy.random.RandomState(0)
        return _sets(lambda i: tuple(rs.standard_normal((b, h, n, d), dtype=cupy.float32).astype(dtype)
                                     for _ in range(3)), nbytes)

    def record(name, tier, seconds, flops=None, nbytes=None, size=""):
        row = {"benchmark": name, "tier": tier, "size": size, "median_s": f"{seconds:.6g}",
               "tflop_s": f"{flops / seconds / 1e12:.4g}" if flops else "",
               "gb_s": f"{nbytes / seconds / 1e9:.4g}" if nbytes else ""}
        rows.append(row)
        log(f"bench {name} [{tier}] {size}: {seconds * 1e3:.3f} ms {row['tflop_s']} TFLOP/s")

    sets = attn_sets(N)
    size = f"B={B} H={H} N={N} d={d} fp16"
    for causal in (False, True):
        flops = 4 * N * N * d * B * H / (2 if causal else 1)  # 4·N²·d per head (FlashAttention-2 §4.1), half causal
        tag = " causal" if causal else ""
        record(f"attention{tag}", "cupy flash (tensor cores)",
               _time(lambda q, k, v: kernels.attention(q, k, v, causal=causal, backend="cupy"), sets), flops,
               size=size)
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]

            def sdpa(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            record(f"attention{tag}", "torch SDPA (FlashAttention-2)", _time(sdpa, tsets), flops, size=size)
        except Exception as err:  # no torch, or no flash backend for these inputs
            rows.append({"benchmark": f"attention{tag}", "tier": "torch SDPA", "size": size,
                         "median_s": "", "tflop_s": "", "gb_s": f"not run: {type(err).__name__}: {err}"[:200]})
    hs = max(1, H // 4)  # the standard algorithm's S is B·H·N² halves: a quarter of the heads
    std_sets = attn_sets(N, b=1, h=hs)
    flops_std = 4 * N * N * d * hs
    record("attention (standard vs flash, fewer heads)", "cupy standard (cuBLAS + softmax kernel)",
           _time(lambda q, k, v: kernels.attention(q, k, v, algorithm="standard", backend="cupy"), std_sets,
                 repeats=5), flops_std, size=f"B=1 H={hs} N={N} d={d} fp16")
    record("attention (standard vs flash, fewer heads)", "cupy flash (tensor cores)",
           _time(lambda q, k, v: kernels.attention(q, k, v, backend="cupy"), std_sets), flops_std,
           size=f"B=1 H={hs} N={N} d={d} fp16")
    n1 = 1024 if quick else 2048  # the readable tier runs one thread per query row: a smaller problem
    t1_sets = attn_sets(n1, dtype=cupy.float32, b=1, h=8)
    flops_t1 = 4 * n1 * n1 * d * 8
    record("attention (tier 1 size)", "numba-cuda flash (fp32)",
           _time(lambda q, k, v: kernels.attention(q, k, v, backend="numba-cuda"), t1_sets, warmup=1, repeats=3),
           flops_t1, size=f"B=1 H=8 N={n1} d={d} fp32")
    t1_half = [tuple(x.astype(cupy.float16) for x in s) for s in t1_sets]
    record("attention (tier 1 size)", "cupy flash (tensor cores)",
           _time(lambda q, k, v: kernels.attention(q, k, v, backend="cupy"), t1_half), flops_t1,
           size=f"B=1 H=8 N={n1} d={d} fp16")

    m = 4096 if not quick else 1024
    a16 = cupy.random.RandomState(1).standard_normal((m, m), dtype=cupy.float32).astype(cupy.float16)
    record("matmul fp16", "cupy matmul (cuBLAS)", _time(lambda a: cupy.matmul(a, a), [(a16,), (a16.copy(),)]),
           2 * m**3, size=f"{m}x{m}x{m}")

    # int8 at M = K = N = 4096 with 1% outlier dimensions (40 of 4096), x float16 values held in float32
    rs = np.random.default_rng(2)
    x = rs.standard_normal((m, m)).astype(np.float32)
    x[:, rs.choice(m, m // 100, replace=False)] *= 20.0
    w = (rs.standard_normal((m, m)) / np.sqrt(m)).astype(np.float32)
    weight = int8.Int8Weight.from_float(w)
    from kernels.int8 import _cupy as int8_tier2

    w_t = cupy.zeros((m, int8_tier2.padded(m)), dtype=cupy.int8)
    w_t[:, :m] = cupy.asarray(weight.w_i8_t)
    absmax_w = cupy.asarray(weight.absmax)
    x_dev = cupy.asarray(x)
    record("int8 split matmul", "cupy (mma.sync s8 + fp16 outliers)",
           _time(lambda xx: int8_tier2.split_matmul(xx, w_t, absmax_w, 6.0), [(x_dev,), (x_dev.copy(),)]),
           2 * m**3, size=f"{m}x{m}x{m}, {m // 100} outlier dims")
    try:
        import bitsandbytes as bnb
        import torch

        layer = bnb.nn.Linear8bitLt(m, m, bias=False, has_fp16_weights=False, threshold=6.0)
        layer.weight = bnb.nn.Int8Params(torch.from_numpy(w.T.copy()).half(), requires_grad=False,
                                         has_fp16_weights=False)
        layer = layer.cuda()
        xt = torch.from_numpy(x).half().cuda()
        record("int8 split matmul", f"bitsandbytes {bnb.__version__} Linear8bitLt",
               _time(lambda xx: layer(xx), [(xt,), (xt.clone(),)]), 2 * m**3, size=f"{m}x{m}x{m}")
    except Exception as err:
        rows.append({"benchmark": "int8 split matmul", "tier": "bitsandbytes", "size": f"{m}x{m}x{m}",
                     "median_s": "", "tflop_s": "", "gb_s": f"not run: {type(err).__name__}: {err}"[:200]})
    return rows


# -- 3. DRAM bytes (Nsight Compute) ------------------------------------------------------------------------------
def predicted_bytes(case: str, s: dict) -> float | None:
    """The cost model's HBM bytes (read + written) for a probe case on the H200 preset; None where the model
    has no counterpart."""
    from . import costs
    from .hardware import load

    h200 = load("H200-SXM")
    if case == "flash":
        c = costs.attention.flash2_forward(s["B"], s["H"], s["H"], s["N"], s["N"], s["d"], elem_bytes=2, Br=64,
                                           Bc=64)
    elif case == "standard":
        c = costs.attention.standard_forward(s["B"], s["H"], s["H"], s["N"], s["N"], s["d"], elem_bytes=2,
                                             sram_bytes=h200.sram_per_sm_bytes)
    elif case == "int8":
        c = costs.matmul.int8_split(s["M"], s["K"], s["N"], s["outliers"], elem_bytes=4, out_bytes=4)
    else:
        return None
    return float(c.hbm_read_bytes + c.hbm_write_bytes)


def dram_bytes(log) -> list[dict]:
    from .gpu_probe import KERNEL_REGEX, sizes

    ncu = shutil.which("ncu")
    rows = []
    for case in ("flash", "standard", "int8", "snapkv"):
        s = sizes(case, small=False)
        row = {"case": case, "size": " ".join(f"{k}={v}" for k, v in s.items()), "ncu_read_bytes": "",
               "ncu_write_bytes": "", "predicted_bytes": "", "predicted_over_measured": "", "note": ""}
        pred = predicted_bytes(case, s)
        row["predicted_bytes"] = f"{pred:.6g}" if pred else ""
        if ncu is None:
            row["note"] = "ncu not on the PATH"
            rows.append(row)
            continue
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--target-processes", "all",
               "--kernel-name", f"regex:{KERNEL_REGEX}", "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
               "--csv", "--page", "raw", "--print-units", "base", sys.executable, "-m", "simulator.gpu_probe", case]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=240)
        read, write, kernels_seen = _parse_ncu(run.stdout)
        if not kernels_seen:
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            row["note"] = "ncu read no counters: " + " / ".join(tail)[:300]
        else:
            row.update(ncu_read_bytes=f"{read:.6g}", ncu_write_bytes=f"{write:.6g}",
                       note=f"{kernels_seen} kernels profiled")
            if pred:
                row["predicted_over_measured"] = f"{pred / (read + write):.3f}"
        rows.append(row)
        log(f"ncu {case}: {row}")
    return rows


def _parse_ncu(text: str):
    """Sum dram__bytes_read/write over the kernels of ncu's ``--csv --page raw`` output."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return 0.0, 0.0, 0
    table = list(csv.DictReader(lines))
    read = write = 0.0
    seen = 0
    for r in table:
        try:
            read += float(str(r.get("dram__bytes_read.sum", "")).replace(",", ""))
            write += float(str(r.get("dram__bytes_write.sum", "")).replace(",", ""))
            seen += 1
        except ValueError:
            continue  # the units row
    return read, write, seen


# -- 4. sanitizers -----------------------------------------------------------------------------------------------
def sanitizers(log) -> list[dict]:
    tool = shutil.which("compute-sanitizer")
    rows = []
    for case in ("flash", "standard", "int8", "snapkv"):
        for check in ("memcheck", "racecheck"):
            row = {"case": case, "tool": check, "errors": "", "note": ""}
            if tool is None:
                row["note"] = "compute-sanitizer not on the PATH"
            else:
                cmd = [tool, "--tool", check, sys.executable, "-m", "simulator.gpu_probe", case, "--small"]
                run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
                found = re.search(r"ERROR SUMMARY: (\d+) error", run.stdout + run.stderr)
                row["errors"] = found.group(1) if found else ""
                row["note"] = "" if found else ("no summary: " + (run.stderr or run.stdout).strip()[-200:])
            rows.append(row)
            log(f"sanitizer {case} {check}: {row['errors']} {row['note']}")
    return rows


# -- 5. the machine and the files --------------------------------------------------------------------------------
def machine_facts() -> list[dict]:
    import cupy

    rows = [{"fact": "date", "value": _dt.datetime.now().isoformat(timespec="seconds")}]
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = ("name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
                  "power.limit,temperature.gpu")
        out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False).stdout.strip().splitlines()
        if out:
            rows += [{"fact": f"nvidia-smi {k}", "value": v.strip()} for k, v in zip(fields.split(","),
                                                                                     out[0].split(","))]
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    rows += [{"fact": "multiprocessors", "value": props["multiProcessorCount"]},
             {"fact": "L2 bytes", "value": props["l2CacheSize"]},
             {"fact": "compute capability", "value": f"{props['major']}.{props['minor']}"},
             {"fact": "CuPy", "value": cupy.__version__}]
    try:
        import numba

        rows.append({"fact": "Numba", "value": numba.__version__})
    except ImportError:
        pass
    return rows


def _write_csv(path, rows):
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _chart(path, bench, dram):
    from .report.charts import figure, save

    fig, axes = figure(ncols=2, width=6.5, height=4.5)
    ax = axes[0][0]
    done = [r for r in bench if r["tflop_s"]]
    ax.barh([f"{r['benchmark']} | {r['tier']}" for r in done], [float(r["tflop_s"]) for r in done],
            color="tab:blue")
    ax.set(xlabel="TFLOP/s (int8: TOP/s), median", title="Measured on this GPU")
    ax.tick_params(axis="y", labelsize=6)
    ax = axes[0][1]
    measured = [r for r in dram if r["ncu_read_bytes"]]
    if measured:
        x = np.arange(len(measured))
        ax.bar(x - 0.2, [(float(r["ncu_read_bytes"]) + float(r["ncu_write_bytes"])) / 1e9 for r in measured], 0.4,
               label="ncu DRAM bytes")
        ax.bar(x + 0.2, [float(r["predicted_bytes"] or 0) / 1e9 for r in measured], 0.4, label="cost model (H200)")
        ax.set_xticks(x, [r["case"] for r in measured])
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no DRAM counters on this machine", ha="center", va="center", transform=ax.transAxes)
    ax.set(ylabel="GB read + written", title="DRAM bytes: measured vs predicted")
    save(fig, path)


def run(out_dir: Path, quick: bool = False, progress=print) -> int:
    """Run the whole check into ``out_dir``; returns 0 if every correctness case passed, else 1."""
    from kernels._common import gpu as _gpu

    if _gpu.cupy_module() is None or _gpu.numba_cuda() is None or _gpu.simulated():
        progress("gpu-check needs a CUDA device with CuPy and numba-cuda (and NUMBA_ENABLE_CUDASIM unset)")
        return 2
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(text):
        progress(f"[{time.perf_counter() - t0:6.1f} s] {text}")

    facts = machine_facts()
    _write_csv(out_dir / "machine.csv", facts)
    checks = correctness(quick, log)
    _write_csv(out_dir / "correctness.csv", checks)
    bench = benchmarks(quick, log)
    _write_csv(out_dir / "benchmarks.csv", bench)
    dram = dram_bytes(log) if not quick else []
    _write_csv(out_dir / "dram_bytes.csv", dram)
    sanit = sanitizers(log) if not quick else []
    _write_csv(out_dir / "sanitizer.csv", sanit)
    _chart(out_dir / "gpu_check.png", bench, dram)
    passed = all(r["passed"] for r in checks)
    md = [f"# ioaware GPU check\n\nRun {facts[0]['value']} by `python -m simulator gpu-check`"
          f"{' --quick' if quick else ''} in {time.perf_counter() - t0:.0f} s. Correctness: "
          f"{'all passed' if passed else 'FAILED'}.\n",
          "## Machine\n", _table(facts, ["fact", "value"]),
          "\n## Correctness against the float64 oracle\n\nflash-attn's rule for float16/bfloat16: error <= 2 × the "
          "plain low-precision error + half an ulp of the output scale.\n",
          _table(checks, ["tier", "kernel", "dtype", "case", "max_abs_error", "bound", "passed"]),
          "\n## Benchmarks (CUDA events, medians, inputs rotated past 4 × L2)\n\nTFLOP/s = 4·N²·d·B·H / t for "
          "attention (half with the causal mask), 2·M·N·K / t for the matmuls.\n",
          _table(bench, ["benchmark", "tier", "size", "median_s", "tflop_s", "gb_s"]),
          "\n## DRAM bytes: Nsight Compute vs the cost model (H200 preset)\n\n"
          "ncu --clock-control none --cache-control all, dram__bytes_read.sum + dram__bytes_write.sum over the "
          "case's kernels.\n", _table(dram, list(dram[0]) if dram else ["case"]),
          "\n## compute-sanitizer\n", _table(sanit, list(sanit[0]) if sanit else ["case"]),
          "\n![benchmarks and DRAM bytes](gpu_check.png)\n"]
    (out_dir / "index.md").write_text("\n".join(md))
    log(f"wrote {out_dir}")
    return 0 if passed else 1
