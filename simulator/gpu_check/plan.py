"""Time estimates of the check's cases, and the dry run (``gpu-check --dry-run``): every part, case and size with
its estimated seconds, on any machine, GPU or not.

No part of this check has run on a GPU yet, so the estimates are formulas over rates, and each rate says where it
comes from: a measurement on the development machine, the H200 preset, or an assumption. Every row the check
writes records its own ``seconds``; after the first GPU run those replace the assumptions here.
"""
from __future__ import annotations

# float64 oracle ``kernels.attn.reference`` (einsum per query row): 3.8-4.7 GFLOP/s measured on the 2-core
# development machine under contention (B=1, H=8, N=1024, d=64 and H=4, d=128), taken for the GPU host's core
HOST_ORACLE_FLOP_S = 4e9
# float32 BLAS of the plain-precision baseline (plain_attention) and NumPy's other host work: an assumption
HOST_BLAS_FLOP_S = 2e10
# per case: inputs drawn and copied, first use of a kernel variant (NVRTC compiled a whole .cu file in 0.1-0.7 s on
# the development machine, tests/kernels/test_cuda_compile.py; CuPy caches it on disk): an assumption
CASE_OVERHEAD_S = 1.5
# per worker process: Python, NumPy, CuPy and a CUDA context: an assumption
WORKER_START_S = 5.0
# first use of the Numba-CUDA kernels in a process (numba-cuda compiles each kernel on first launch): an assumption
NUMBA_JIT_S = 20.0
# one Nsight Compute run of a probe (two DRAM metrics, a few replay passes per kernel); one compute-sanitizer run at
# the small sizes: the process's start under the tool, then each probe in it: assumptions
NCU_RUN_S = 45.0
SANITIZER_START_S = 15.0
SANITIZER_PROBE_S = 10.0
# a part may run MARGIN × its estimate (the estimates may be off by that much), leaving each later part RESERVE × its
# own (the parts come in order of priority: correctness first, DRAM bytes last)
MARGIN = 2.0
RESERVE = 0.5
# the fraction of the H200 preset's dense fp16 tensor rate the kernels are assumed to reach (for time per call)
DEVICE_EFFICIENCY = 0.3


def _device_flop_s() -> float:
    from ..hardware import load

    return DEVICE_EFFICIENCY * load("H200-SXM").fp16_flops


def attention_case_s(B, Hq, Nq, Nk, d, low_precision: bool) -> float:
    """A correctness case: the float64 oracle (4·Nq·Nk·d per head: S = QKᵀ and PV, FlashAttention-2 §4.1) and, in
    float16/bfloat16, the plain baseline."""
    flops = 4 * B * Hq * Nq * Nk * d
    return CASE_OVERHEAD_S + flops / HOST_ORACLE_FLOP_S + (flops / HOST_BLAS_FLOP_S if low_precision else 0.0)


def int8_case_s(M, K, N) -> float:
    """A correctness case of int8: the CPU tier's GEMM (2·M·K·N) on the host."""
    return CASE_OVERHEAD_S + 2 * M * K * N / HOST_BLAS_FLOP_S


def snapkv_case_s(Hq, N, d, window) -> float:
    """A SnapKV correctness case: the oracle's window scores (2·w·N·d per query head, twice)."""
    return CASE_OVERHEAD_S + 4 * Hq * window * N * d / HOST_ORACLE_FLOP_S


def benchmark_case_s(flops_per_call: float, calls: int) -> float:
    """A benchmark: inputs made on the device, then ``calls`` timed and warm-up calls at the assumed rate."""
    return CASE_OVERHEAD_S + calls * flops_per_call / _device_flop_s()


def numba_limit_s(estimate_s: float) -> float:
    """Time limit of a case on the Numba-CUDA tier: the first one in a worker compiles its kernels."""
    return max(60.0, 5.0 * estimate_s) + 3.0 * NUMBA_JIT_S


def part_estimate_s(cases) -> float:
    """A part: its cases, one worker start, and Numba's first compile when a case runs the Numba-CUDA tier."""
    numba = any("numba-cuda" in c.needs for c in cases)
    return WORKER_START_S + (NUMBA_JIT_S if numba else 0.0) + sum(c.estimate_s for c in cases)


def part_budget(estimate_s: float, later_estimates_s, left_s: float) -> float:
    """Seconds a part may run: its estimate, and up to MARGIN × it where that still leaves every later part RESERVE
    × its own; never more than is left. Parts come in order of priority, so when time is short the earlier parts
    keep theirs and the last ones are cut."""
    reserve = RESERVE * sum(later_estimates_s)
    return max(0.0, min(left_s, MARGIN * estimate_s, max(estimate_s, left_s - reserve)))


def dry_run(parts, quick: bool, deadline_s: float) -> str:
    """The plan as text: each part's cases, sizes and estimates, the part totals and the deadline's shares."""
    from ._runner import load_part

    lines = [f"gpu-check plan{' (--quick)' if quick else ''}: estimates, not measurements (simulator/gpu_check/"
             f"plan.py says where each rate comes from); global deadline {deadline_s:.0f} s", ""]
    totals = {}
    for name, factory in parts:
        _, make_cases = load_part(factory)
        cases = make_cases(quick)
        totals[name] = part_estimate_s(cases)
        lines.append(f"{name}: {len(cases)} cases, estimated {totals[name]:.0f} s")
        for case in cases:
            needs = f"  needs {', '.join(case.needs)}" if case.needs else ""
            lines.append(f"  {case.estimate_s:7.1f} s  {case.name} [{case.size}]{needs}")
    total = sum(totals.values())
    lines += ["", f"total estimated {total:.0f} s against a deadline of {deadline_s:.0f} s. Budgets if every part "
                  f"takes its estimate (each part gets its estimate, and up to {MARGIN:g} × it while the later ones "
                  f"keep {RESERVE:g} × theirs, in order of priority):"]
    left = deadline_s
    names = list(totals)
    for i, name in enumerate(names):
        budget = part_budget(totals[name], [totals[n] for n in names[i + 1:]], left)
        lines.append(f"  {name}: up to {budget:.0f} s")
        left -= min(budget, totals[name])
    return "\n".join(lines)
