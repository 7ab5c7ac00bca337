"""Time per phase of this library's CPU kernels: each phase's work split by kind, each kind at a calibrated rate.

The roofline of ``Cost.time`` charges every kernel max(FLOPs / peak, bytes / DRAM bandwidth) on all cores. The CPU
kernels do not run that way, and this module models what they run (``kernels/attn/_standard.py``,
``kernels/attn/_numba_cpu.py``, ``kernels/_common/blas.py``):

- the standard algorithm's matmuls S = QKᵀ and O = PV run as BLAS blocks on all of Numba's threads, each at the
  GEMM rate of its own shape class (K = d for QKᵀ, K = N for PV); its elementwise passes (row max, P = scale·(S −
  max), exp, row sum, P /= l, the causal mask) run in NumPy on **one core**, each at the rate one core reaches for
  that kind of pass (a row reduction, an in-place update, a pass into a new array, a masked store, an in-place exp),
  from the last-level cache when the pass's arrays fit in it, else from DRAM;
- the flash kernel runs tasks of (batch, kv head, query block, key split) on all threads, statically split into
  equal contiguous chunks (Numba's parallel loop); each task's time is its block matmuls at the per-thread rate of
  those block shapes, its exps at the per-thread rate of the kernel's own vectorized exp, and the rescale of O_i at
  a per-thread multiply-add rate; the slowest thread's chunk is the kernel's time, plus one parallel-region launch;
- a decode step is the flash kernel with Nq = 1: its K/V bytes at the all-core read bandwidth, plus the fixed cost
  of one call (validation, allocation, launches) measured on this machine.

Every rate is a ``PhaseRates`` field, measured by ``simulator.calibrate_phases.phase_rates``. Sizes are plain integers
(one configuration at a time: the flash model sums over the kernel's tasks).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# glibc's malloc serves a request above its mmap threshold with fresh pages from mmap and returns them on free;
# the threshold adapts upwards, to the size of an mmapped block when it is freed, but never beyond
# DEFAULT_MMAP_THRESHOLD_MAX, 4·1024·1024·sizeof(long) = 32 MiB on 64-bit (glibc malloc/malloc.c,
# "M_MMAP_THRESHOLD").
# So an allocation at or above 32 MiB is page-faulted in by whatever first writes it, on every call; one below comes
# from the heap, mapped, from the second call on (the first call's free raised the threshold). That holds for one
# allocation per size: the standard algorithm keeps S and P in one (``kernels/attn/_standard.py`` says why).
MMAP_THRESHOLD_MAX = 32 * 2**20


def _faulted_in(allocation_bytes) -> bool:
    """Whether a block allocated on every call is faulted in on every call: at or above glibc's mmap ceiling."""
    return allocation_bytes >= MMAP_THRESHOLD_MAX


# (field, unit factor for the TOML file, unit) in the order the file lists them
_FIELDS = (
    ("threads", 1, ""), ("llc_bytes", 2**20, "MiB"),
    ("reduce_llc", 1e9, "GB/s"), ("reduce_dram", 1e9, "GB/s"),
    ("update_llc", 1e9, "GB/s"), ("update_dram", 1e9, "GB/s"),
    ("into_llc", 1e9, "GB/s"), ("into_dram", 1e9, "GB/s"),
    ("divide_llc", 1e9, "GB/s"), ("divide_dram", 1e9, "GB/s"),
    ("fresh_dram", 1e9, "GB/s"), ("masked_llc", 1e9, "GB/s"), ("masked_dram", 1e9, "GB/s"),
    ("exp_llc", 1e9, "G/s"), ("exp_dram", 1e9, "G/s"),
    ("read_all", 1e9, "GB/s"), ("write_all", 1e9, "GB/s"), ("first_touch_all", 1e9, "GB/s"),
    ("gemm_qk", 1e9, "GFLOP/s"), ("gemm_pv", 1e9, "GFLOP/s"), ("gemm_block", 1e9, "GFLOP/s"),
    ("exp_block", 1e9, "G/s"), ("max_block", 1e9, "G/s"), ("fma_block", 1e9, "G/s"),
    ("row_step_s", 1e-9, "ns"),
    ("read_all_llc", 1e9, "GB/s"), ("read_one_llc", 1e9, "GB/s"), ("read_one_dram", 1e9, "GB/s"),
    ("decode_stream", 1e9, "GB/s"), ("decode_stream_one", 1e9, "GB/s"), ("gemv_fp32_llc", 1e9, "GB/s"),
    ("gemv_fp32_dram", 1e9, "GB/s"), ("gemv_fp32_dram_wide", 1e9, "GB/s"),
    ("step_fp32_dram", 1e9, "GB/s"), ("step_int8_dram", 1e9, "GB/s"), ("step_outlier_s", 1e-9, "ns"),
    ("int8_gemv_llc", 1e9, "GB/s"), ("int8_gemv_dram", 1e9, "GB/s"), ("int8_gemv_one_llc", 1e9, "GB/s"),
    ("int8_gemv_one_dram", 1e9, "GB/s"), ("int8_outlier_s", 1e-9, "ns"),
    ("launch_s", 1e-6, "us"), ("attention_call_s", 1e-6, "us"), ("int8_call_s", 1e-6, "us"),
    ("gemm_d", 1, ""), ("block_br", 1, ""), ("block_bc", 1, ""),
    ("calibration_s", 1, "s"),
)


@dataclass(frozen=True)
class PhaseRates:
    """Rates of one CPU, per kind of work and thread count, in SI units (bytes/s, FLOP/s, elements/s, seconds).

    One core, NumPy (the standard algorithm's elementwise passes), ``_llc`` from the last-level cache and
    ``_dram`` from DRAM, bytes counted as read + written: ``reduce_*`` a row reduction (max, sum; bytes read),
    ``update_*`` an in-place ``x op= y`` (a multiply), ``into_*`` ``z = x op y`` into another array, mapped
    (the core reads z's lines before it writes them, write-allocate: three streams where the in-place op has two),
    ``divide_*`` an in-place ``x /= y`` (a division's throughput is a fraction of a multiply's), ``fresh_dram``
    ``z = x op y`` into a new array beyond the mmap threshold (its page faults included), ``masked_*``
    ``np.copyto(x, c, where=mask)`` (bytes of x), ``exp_*`` an in-place ``np.exp`` (elements/s). ``llc_bytes`` is
    the footprint up to which a pass runs at the ``_llc`` rates: where one core's read rate has fallen half-way
    (geometrically) from the cache's to DRAM's; ``llc_curve_bytes`` and ``llc_curve_fraction`` that curve (one
    core's read rate at each footprint, 1 at the cache's rate to 0 at DRAM's), ``llc_curve_all_fraction`` the same
    for all cores' read rate (for work on all threads).

    All threads: ``read_all`` and ``write_all`` DRAM bandwidth (a read-only sum; a triad), ``first_touch_all`` the
    rate at which threads fault in new pages (the extra over writing mapped ones); ``gemm_qk`` and ``gemm_pv`` the
    standard algorithm's batched matmuls (K = ``gemm_d``, and K = N with ``gemm_d`` columns); per thread with all
    threads busy: ``gemm_block`` the flash kernel's two block products at ``block_br`` × ``block_bc`` tiles,
    ``exp_block`` its vectorized exp, ``max_block`` its row max (``row_max``, scores/s), ``fma_block`` a
    multiply-add over a tile, ``row_step_s`` the seconds per query
    row and key block that the kernel takes beyond those parts (its online-softmax bookkeeping, the first block's
    row max: measured as the whole kernel's excess over them at one size). ``launch_s``: one parallel region;
    ``attention_call_s``: a whole ``kernels.attention`` call on a tiny decode input; ``int8_call_s`` a whole
    ``Int8Linear`` call on a tiny vector. ``read_all_llc``: the all-core read rate from the last-level cache;
    ``read_one_llc`` and ``read_one_dram``: one core's read rate from the last-level cache and from DRAM;
    ``decode_stream`` and ``decode_stream_one``: the K/V bytes/s that a decode call of ``kernels.attention`` (a few
    query rows against Bc keys at a time, the flash kernel with Br = 1) streams from DRAM, on all threads and on
    the calling thread;
    ``gemv_fp32_*``: NumPy's float32 GEMV (its own BLAS, all cores) in weight bytes/s, from the cache and DRAM
    (rows of K = ``GEMV_K`` = 4096; ``gemv_fp32_dram_wide`` from DRAM at K = ``GEMV_WIDE_K`` = 8192: OpenBLAS's
    rate depends on the row length, 33 against 28 GB/s on the 2-vCPU Xeon);
    ``step_fp32_dram`` and ``step_int8_dram``: the weight bytes/s at which the row kernels of the one-region
    decode step (``kernels.dense.gemv_rows``, ``kernels.int8.panels.layout_rows``) stream a weight from DRAM, its
    rows split evenly over all threads in one parallel region; ``step_outlier_s`` a thread's seconds per output and
    outlier feature in ``layout_rows`` (the float16 path's products). ``int8_gemv_llc``, ``int8_gemv_dram``,
    ``int8_gemv_one_llc`` and ``int8_gemv_one_dram``: the int8 weight bytes/s of ``Int8Linear``'s one-vector
    kernel on all threads from the cache and from DRAM, and on the calling thread from the cache and from DRAM
    (each call's fixed cost left out); ``int8_outlier_s`` a thread's seconds per output and outlier feature.
    ``calibration_s``: how long measuring all of this took.
    """

    threads: int
    llc_bytes: float
    reduce_llc: float
    reduce_dram: float
    update_llc: float
    update_dram: float
    into_llc: float
    into_dram: float
    divide_llc: float
    divide_dram: float
    fresh_dram: float
    masked_llc: float
    masked_dram: float
    exp_llc: float
    exp_dram: float
    read_all: float
    write_all: float
    first_touch_all: float
    gemm_qk: float
    gemm_pv: float
    gemm_block: float
    exp_block: float
    max_block: float
    fma_block: float
    row_step_s: float
    read_all_llc: float
    read_one_llc: float
    read_one_dram: float
    decode_stream: float
    decode_stream_one: float
    gemv_fp32_llc: float
    gemv_fp32_dram: float
    gemv_fp32_dram_wide: float
    step_fp32_dram: float
    step_int8_dram: float
    step_outlier_s: float
    int8_gemv_llc: float
    int8_gemv_dram: float
    int8_gemv_one_llc: float
    int8_gemv_one_dram: float
    int8_outlier_s: float
    launch_s: float
    attention_call_s: float
    int8_call_s: float
    gemm_d: int
    block_br: int
    block_bc: int
    llc_curve_bytes: tuple = ()
    llc_curve_fraction: tuple = ()
    llc_curve_all_fraction: tuple = ()
    calibration_s: float = 0.0

    def __post_init__(self):
        n = len(self.llc_curve_bytes)
        if n < 1 or n != len(self.llc_curve_fraction) or n != len(self.llc_curve_all_fraction):
            raise ValueError("PhaseRates.llc_curve_bytes, llc_curve_fraction and llc_curve_all_fraction must be "
                             "equal, non-empty lists")
        for name, _, _ in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"PhaseRates.{name} must be a finite number; got {value!r}")
            if value < 0 or (value == 0 and name not in ("calibration_s", "launch_s", "row_step_s")):
                raise ValueError(f"PhaseRates.{name} must be > 0; got {value!r}")

    def to_toml(self) -> str:
        """The rates as TOML in readable units (GB/s, GFLOP/s, µs), 10 significant digits (read back exactly)."""
        lines = []
        for name, factor, unit in _FIELDS:
            value = getattr(self, name)
            text = str(value) if isinstance(value, int) and factor == 1 else format(value / factor, ".10g")
            lines.append(f"{name} = {text}" + (f"  # {unit}" if unit else ""))
        lines.append("llc_curve_bytes = [" + ", ".join(str(int(b)) for b in self.llc_curve_bytes) + "]")
        for name in ("llc_curve_fraction", "llc_curve_all_fraction"):
            lines.append(f"{name} = [" + ", ".join(format(f, ".10g") for f in getattr(self, name)) + "]")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str, origin: str = "<toml>") -> "PhaseRates":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{origin}: not valid TOML: {err}") from None
        curves = ["llc_curve_bytes", "llc_curve_fraction", "llc_curve_all_fraction"]
        names = [name for name, _, _ in _FIELDS] + curves
        missing, unknown = sorted(set(names) - data.keys()), sorted(data.keys() - set(names))
        if missing or unknown:
            raise ValueError(f"{origin}: missing {missing}, unknown {unknown}")
        ints = {"threads", "gemm_d", "block_br", "block_bc"}
        values = {name: int(data[name]) if name in ints else data[name] * factor for name, factor, _ in _FIELDS}
        return cls(**values, **{name: tuple(float(x) for x in data[name]) for name in curves})

    def replace(self, **changes) -> "PhaseRates":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Phase:
    """One phase of a kernel: its predicted seconds, the kind of work that sets them, the threads it runs on, and
    the work it does (FLOPs, exps, bytes)."""

    name: str
    seconds: float
    kind: str  # "gemm", "exp", "reduce", "update", "into", "divide", "fresh", "masked", "rows", "read" or "call"
    threads: int
    flops: float = 0.0
    exps: float = 0.0
    bytes: float = 0.0


def total_seconds(phases) -> float:
    return sum(p.seconds for p in phases)


def cache_fraction(rates, footprint, all_cores=False):
    """How far a pass over ``footprint`` bytes runs at cache speed, 1 (all from the cache) to 0 (from DRAM): one
    core's measured read rate at that footprint (all cores' with ``all_cores``), placed between the cache's and
    DRAM's on a log scale (``rates.llc_curve``, interpolated in log footprint; flat beyond its ends)."""
    sizes = rates.llc_curve_bytes
    fractions = rates.llc_curve_all_fraction if all_cores else rates.llc_curve_fraction
    if footprint <= sizes[0]:
        return fractions[0]
    for (s0, f0), (s1, f1) in zip(zip(sizes, fractions), zip(sizes[1:], fractions[1:])):
        if footprint <= s1:
            w = math.log(footprint / s0) / math.log(s1 / s0)
            return f0 + w * (f1 - f0)
    return fractions[-1]


def pass_rate(rates, kind, footprint):
    """One core's rate of a pass of ``kind`` over ``footprint`` bytes: the ``_llc`` and ``_dram`` rates of that
    kind weighted geometrically by ``cache_fraction``."""
    f = cache_fraction(rates, footprint)
    return getattr(rates, f"{kind}_dram") ** (1 - f) * getattr(rates, f"{kind}_llc") ** f


def _pass(rates, name, kind, traffic, footprint):
    """A one-core NumPy pass of ``kind`` moving ``traffic`` bytes over arrays of ``footprint`` bytes."""
    return Phase(name, traffic / pass_rate(rates, kind, footprint), kind, 1, bytes=traffic)


def _new_array(rates, name, read_bytes, new_bytes, allocation_bytes=None):
    """A one-core pass that reads ``read_bytes`` and writes ``new_bytes`` of an allocation of ``allocation_bytes``
    (by default ``new_bytes``) made for this call: fresh pages at or above the mmap threshold, else heap memory
    already mapped (the rate of a pass into another array)."""
    if _faulted_in(allocation_bytes or new_bytes):
        return Phase(name, (read_bytes + new_bytes) / rates.fresh_dram, "fresh", 1, bytes=read_bytes + new_bytes)
    return _pass(rates, name, "into", read_bytes + new_bytes, read_bytes + new_bytes)


def _gemm(rates, name, flops, rate, read_bytes, write_bytes=0, new_bytes=0, allocation_bytes=None):
    """A matmul on all threads: compute at its shape's rate plus its DRAM traffic at the all-core bandwidths (a
    sum, not the roofline's max: BLAS copies each panel into a packed buffer before it computes on it, so a panel
    streamed from DRAM is not overlapped with the products), plus the page faults of its ``new_bytes`` of output
    when their allocation (``allocation_bytes``, by default ``new_bytes``) is at or above the mmap threshold, plus
    one launch."""
    memory_s = read_bytes / rates.read_all + write_bytes / rates.write_all
    faults_s = new_bytes / rates.first_touch_all if _faulted_in(allocation_bytes or new_bytes) else 0.0
    return Phase(name, flops / rate + memory_s + faults_s + rates.launch_s, "gemm", rates.threads,
                 flops=flops, bytes=read_bytes + write_bytes)


def _check(**sizes):
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")


def standard_phases(rates: PhaseRates, B, Hq, Hkv, Nq, Nk, d, *, causal=False, elem_bytes=4) -> tuple[Phase, ...]:
    """The phases of ``kernels.attention(algorithm="standard")`` on the CPU (``kernels/attn/_standard.py``), named
    as ``kernels.attn.STANDARD_PHASES``. E = B·Hq·Nq·Nk scores of ``elem_bytes`` each."""
    _check(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, elem_bytes=elem_bytes)
    e = elem_bytes
    E = B * Hq * Nq * Nk
    s_bytes = E * e
    kv_bytes = B * Hkv * Nk * d * e
    q_bytes = B * Hq * Nq * d * e
    # Every pass is placed on the cache curve at the S-and-P allocation (2·S), not at the S or P it reads:
    # subtract streams both halves, and the passes after it compete with what it left. On the 2-vCPU Xeon VM,
    # at N = 1024 with 8 heads (S 32 MiB), the passes over P ran at the rates the one-core curve gives 64 MiB:
    # placed at 32 MiB the standard algorithm was predicted 20-25% short, at 64 MiB within 5% (512 to 4096).
    s_dram = s_bytes * (1 - cache_fraction(rates, 2 * s_bytes))  # the share of S and P that reaches DRAM
    phases = [
        # S = QKᵀ, one GEMM of K = d per kv head on all threads, into the first half of a new buffer for S and P
        _gemm(rates, "qk", 2 * E * d, rates.gemm_qk, q_bytes + kv_bytes, s_dram, new_bytes=s_bytes,
              allocation_bytes=2 * s_bytes),
    ]
    if causal:
        # the (Nq, Nk) boolean mask and its negation, two new arrays, then S[~visible] = -inf in one masked store
        mask = Nq * Nk
        build = _new_array(rates, "mask", 0, 2 * mask)
        store = _pass(rates, "mask", "masked", 2 * s_bytes, 2 * s_bytes + mask)
        phases.append(Phase("mask", build.seconds + store.seconds, "masked", 1, bytes=build.bytes + store.bytes))
    phases.append(_pass(rates, "max", "reduce", s_bytes, 2 * s_bytes))
    # P = S − max into the buffer's second half, then P *= scale in place
    sub = _new_array(rates, "subtract", s_bytes, s_bytes, allocation_bytes=2 * s_bytes)
    scale = _pass(rates, "subtract", "update", 2 * s_bytes, 2 * s_bytes)
    phases.append(Phase("subtract", sub.seconds + scale.seconds, sub.kind, 1, bytes=sub.bytes + scale.bytes))
    # exp in place: the in-place ufunc's own rate, by where P lies
    exp_rate = pass_rate(rates, "exp", 2 * s_bytes)
    phases.append(Phase("exp", E / exp_rate, "exp", 1, exps=E, bytes=2 * s_bytes))
    phases.append(_pass(rates, "sum", "reduce", s_bytes, 2 * s_bytes))
    phases.append(_pass(rates, "normalize", "divide", 2 * s_bytes, 2 * s_bytes))  # P /= l
    # O = PV, one GEMM of K = Nk per kv head on all threads, reading P
    phases.append(_gemm(rates, "pv", 2 * E * d, rates.gemm_pv, s_dram + kv_bytes))
    return tuple(phases)


def flash_split_count(tasks, n_key_blocks, threads):
    """Split-KV factor of the CPU flash kernel (``kernels/attn/_api.py``, ``_split_count``; Flash-Decoding): with
    fewer than 4 tasks per thread, split the keys so that every thread gets several tasks and all the same number."""
    if tasks >= 4 * threads or n_key_blocks <= 1:
        return 1
    n_splits = math.ceil(4 * threads / tasks)
    while (tasks * n_splits) % threads and n_splits < n_key_blocks:
        n_splits += 1
    return min(n_splits, n_key_blocks)


def _task_work(rows, br, r0, keys, k0, k1, Bc, d, causal, offset):
    """(matmul FLOPs, exps, scores of the row-max pass, multiply-adds, query rows × key blocks) of one flash task:
    the query block of ``rows`` = group·br rows at r0 against keys [k0, k1), block by block as ``flash_forward``
    runs them; the row max is taken over a row's first block only (lazy rescaling after it)."""
    flops = exps = maxes = fmas = row_blocks = 0
    first = True
    for c0 in range(k0, k1, Bc):
        bc = min(Bc, k1 - c0)
        flops += 4 * rows * bc * d  # S_ij = Q_i K_jᵀ and P_ij V_j, each 2·rows·bc·d, masked part included
        if causal and c0 + bc - 1 > r0 + offset:  # a diagonal block: each row's exps stop at its last visible key
            group = rows // br
            block_exps = group * sum(max(0, min(bc, r0 + i + offset - c0 + 1)) for i in range(br))
        else:
            block_exps = rows * bc
        exps += block_exps
        if first:
            maxes += block_exps  # the row max over the same visible scores
            first = False
        fmas += rows * d  # O_i ← diag(alpha) O_i + P_ij V_j
        row_blocks += rows
    return flops, exps, maxes, fmas, row_blocks


SERIAL_MULTIPLY_ADDS = 2**24  # kernels._common.threads: an attention call or an int8 GEMV below this runs on the
# calling thread
# alone (restated: the cost model does not import the kernels; tests hold the two equal)


def attention_multiply_adds(B, Hq, Nq, Nk, d, causal) -> int:
    """Multiply-adds of S = QKᵀ and O = PV over the (query, key) pairs a query sees (``kernels.attn``'s
    ``multiply_adds``): 2 · B · Hq · d · pairs; with ``causal``, query i of Nq sees keys j <= i + Nk − Nq."""
    n = min(Nq, Nk)  # causal: the last n rows see Nk − n + 1, ..., Nk keys (the others none)
    pairs = Nq * Nk if not causal else n * (2 * Nk - n + 1) // 2
    return 2 * B * Hq * d * pairs


def attention_threads(rates: PhaseRates, B, Hq, Nq, Nk, d, causal) -> int:
    """Threads a ``kernels.attention`` call runs on: one below ``SERIAL_MULTIPLY_ADDS``, else all."""
    small = attention_multiply_adds(B, Hq, Nq, Nk, d, causal) < SERIAL_MULTIPLY_ADDS
    return 1 if small else rates.threads


def flash_phases(rates: PhaseRates, B, Hq, Hkv, Nq, Nk, d, *, causal=False, Br, Bc, elem_bytes=4
                 ) -> tuple[Phase, ...]:
    """The phases of ``kernels.attention(algorithm="flash")`` on the CPU (``kernels/attn/_numba_cpu.py``) with
    tiles Br × Bc (``kernels.attn.default_blocks``): the block matmuls ("qk", "pv"), the exps and the first
    block's row max ("softmax") and the rescale of O_i ("rescale"), as the slowest thread runs them; the K/V
    traffic when it is longer ("read"); the page faults of the workers' tiles, one allocation per call
    (``kernels/attn/_api.py``), when it is at or above the mmap threshold ("tiles"); and the measured fixed cost
    of one call ("call"), plus the merge's launch when the keys are split."""
    _check(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, Br=Br, Bc=Bc, elem_bytes=elem_bytes)
    group = Hq // Hkv
    Br, Bc = min(Br, Nq), min(Bc, Nk)
    Tr = -(-Nq // Br)
    offset = Nk - Nq
    all_threads = attention_threads(rates, B, Hq, Nq, Nk, d, causal)
    n_splits = flash_split_count(B * Hkv * Tr, -(-Nk // Bc), all_threads)
    per_block = {}  # (query block, split) -> work; identical over batch and kv heads
    for ib in range(Tr):
        r0 = ib * Br
        br = min(Br, Nq - r0)
        kend = max(0, min(Nk, r0 + br + offset)) if causal else Nk
        per_split = -(-(-(-kend // Bc)) // n_splits)
        for split in range(n_splits):
            k0, k1 = min(kend, split * per_split * Bc), min(kend, (split + 1) * per_split * Bc)
            per_block[ib, split] = _task_work(group * br, br, r0, kend, k0, k1, Bc, d, causal, offset)
    # tasks in the kernel's order (batch, kv head, query block, split), in equal contiguous chunks per thread
    order = [per_block[ib, sp] for _ in range(B * Hkv) for ib in range(Tr) for sp in range(n_splits)]
    threads = min(all_threads, len(order))
    chunk = -(-len(order) // threads)
    slowest = max((tuple(map(sum, zip(*order[t * chunk:(t + 1) * chunk]))) for t in range(threads)
                   if order[t * chunk:(t + 1) * chunk]), key=lambda w: w[0] / rates.gemm_block + w[1] /
                  rates.exp_block + w[2] / rates.max_block + w[3] / rates.fma_block + w[4] * rates.row_step_s)
    flops, exps, maxes, fmas, row_blocks = slowest
    # each worker (one per thread that has a task) has Q_i, O_i, P·V (rows × d), S and P (rows × Bc) and m_i, l_i,
    # alpha (rows), rows = group·Br (``kernels.attn._numba_cpu.task_elements``), all in one new array
    tiles = threads * elem_bytes * (3 * group * Br * d + 2 * group * Br * Bc + 3 * group * Br)
    tiles_s = tiles / rates.first_touch_all if _faulted_in(tiles) else 0.0
    compute = [Phase("qk", flops / 2 / rates.gemm_block, "gemm", threads, flops=flops / 2),
               Phase("softmax", exps / rates.exp_block + maxes / rates.max_block, "exp", threads, exps=exps),
               Phase("pv", flops / 2 / rates.gemm_block, "gemm", threads, flops=flops / 2),
               Phase("rescale", fmas / rates.fma_block, "update", threads),
               Phase("tiles", tiles_s, "fresh", threads, bytes=tiles if tiles_s else 0.0),
               Phase("bookkeeping", row_blocks * rates.row_step_s, "rows", threads)]
    # K and V cross DRAM once per kv head when a head's K/V stay in the cache between query blocks (they are
    # re-read from it), Q read and O written once
    e = elem_bytes
    dram_bytes = 2 * B * Hkv * Nk * d * e + 2 * B * Hq * Nq * d * e
    read_s = dram_bytes / rates.read_all * (rates.threads / threads)  # one thread: its share of the all-core rate
    phases = compute
    compute_s = total_seconds(compute)
    if read_s > compute_s:  # memory-bound (decode): the traffic sets the time, the compute hides under it
        phases = [Phase("read", read_s, "read", threads, bytes=dram_bytes)] + [
            dataclasses.replace(p, seconds=0.0) for p in compute]
    launches = 1 + (n_splits > 1)  # the flash kernel, and the merge of the key splits
    # (the tiny call runs on one thread, so it holds no region; a call on the pool pays one per launch)
    extra = [Phase("call", rates.attention_call_s + (launches if threads > 1 else 0) * rates.launch_s, "call", 1)]
    return tuple(phases) + tuple(extra)


def decode_phases(rates: PhaseRates, B, Hq, Hkv, n_kept, d, *, Bc, elem_bytes=4) -> tuple[Phase, ...]:
    """One decode step of ``kernels.attention`` (one new query against ``n_kept`` cached tokens; a pruned cache
    keeps fewer): the flash kernel with Br = 1, whose block products are skinny GEMMs (the query heads of a GQA
    group against Bc keys), so its K/V bytes stream at the rate measured for such a call (``rates.decode_stream``
    on all threads, ``decode_stream_one`` on the calling thread, from DRAM), not at the read bandwidth; plus the
    fixed cost of the call and the launch that merges the key splits."""
    _check(B=B, Hq=Hq, Hkv=Hkv, n_kept=n_kept, d=d, Bc=Bc, elem_bytes=elem_bytes)
    kv_bytes = 2 * B * Hkv * n_kept * d * elem_bytes
    threads = attention_threads(rates, B, Hq, 1, n_kept, d, True)
    n_splits = flash_split_count(B * Hkv, -(-n_kept // min(Bc, n_kept)), threads)
    # the cache is cold, whatever its size: in a model each layer has its own, and the weights stream in between.
    # A small call runs on the calling thread, at the rate measured on such calls (decode_stream_one: short caches
    # met cold, each stream paying the memory's latency), not at a share of the all-thread rate
    stream = rates.decode_stream if threads == rates.threads else rates.decode_stream_one
    launches = 1 + (n_splits > 1)
    return (Phase("read", kv_bytes / stream, "read", threads, flops=4 * B * Hq * n_kept * d, bytes=kv_bytes),
            Phase("call", rates.attention_call_s + (launches if threads > 1 else 0) * rates.launch_s, "call", 1))


def _by_level(rates, llc_rate, dram_rate, footprint, all_cores=False):
    """The rate of a pass over ``footprint`` bytes between its cache and DRAM rates (``cache_fraction``); DRAM's
    for an infinite footprint (data that no cache holds when the pass starts)."""
    if math.isinf(footprint):
        return dram_rate
    f = cache_fraction(rates, footprint, all_cores)
    return dram_rate ** (1 - f) * llc_rate ** f


GEMV_K, GEMV_WIDE_K = 4096, 8192  # the row lengths at which NumPy's float32 GEMV is calibrated from DRAM


def dense_gemv_phases(rates: PhaseRates, K, N, *, resident=True) -> tuple[Phase, ...]:
    """y = x · Wᵀ for one float32 vector x (K,) and W (N, K) in NumPy (its BLAS on all cores): the weight's bytes
    at the GEMV rate measured for where they lie: with ``resident`` (the same W called again) the cache or DRAM by
    the all-core curve; without (each call on another layer's W, as in a decode step) DRAM."""
    _check(K=K, N=N)
    w_bytes = 4 * K * N
    # DRAM: the two calibrated row lengths, interpolated in log K between them, the nearer one outside
    t = min(1.0, max(0.0, math.log2(K / GEMV_K) / math.log2(GEMV_WIDE_K / GEMV_K)))
    dram = rates.gemv_fp32_dram ** (1 - t) * rates.gemv_fp32_dram_wide ** t
    rate = _by_level(rates, rates.gemv_fp32_llc, dram, w_bytes if resident else math.inf, all_cores=True)
    return (Phase("gemv", w_bytes / rate, "read", rates.threads, flops=2 * K * N, bytes=w_bytes),)


def int8_gemv_phases(rates: PhaseRates, K, N, n_outliers=0, *, resident=True) -> tuple[Phase, ...]:
    """``Int8Linear`` on one vector: the int8 weight (N·K bytes, and N float32 scales) streamed at the kernel's
    rate measured for where it lies (``resident`` as for ``dense_gemv_phases``), plus the fixed cost of a call
    (outlier scan, quantization) measured on a tiny vector; the ``n_outliers`` weight columns dequantized on the
    float path add N·n_outliers bytes and each output's float16 products of them (``int8_outlier_s``). Below
    ``SERIAL_MULTIPLY_ADDS`` (K·N) the call runs on the calling thread and holds no region; a larger one runs on
    the pool and pays one region's launch."""
    _check(K=K, N=N)
    w_bytes = K * N + 4 * N + N * n_outliers
    footprint = w_bytes if resident else math.inf
    threads = 1 if K * N < SERIAL_MULTIPLY_ADDS else rates.threads
    if threads == 1:
        read_s = w_bytes / _by_level(rates, rates.int8_gemv_one_llc, rates.int8_gemv_one_dram, footprint)
    else:
        read_s = w_bytes / _by_level(rates, rates.int8_gemv_llc, rates.int8_gemv_dram, footprint, all_cores=True)
    read_s += N * n_outliers * rates.int8_outlier_s / threads  # the float16 path of each output
    return (Phase("int8_gemv", read_s, "read", threads, flops=2 * K * N, bytes=w_bytes),
            Phase("call", rates.int8_call_s + (rates.launch_s if threads > 1 else 0.0), "call", 1))
