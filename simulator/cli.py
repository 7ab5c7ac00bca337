"""Command line: ``python -m simulator`` or ``ioaware``: ``report``, ``costs``, ``hardware``, ``gpu-check`` and
``explain``."""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

from tqdm import tqdm

DEFAULT_HARDWARE = "H100-SXM"
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def _hardware(name):
    """argparse type: a preset name, 'cpu' (this machine, calibrated), or a TOML path; unknown names list the
    known ones."""
    from .hardware import load

    if name.lower() == "cpu":
        from .calibrate import cpu_spec

        return cpu_spec()
    try:
        return load(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _whole(text, minimum):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _positive(text):
    """argparse type: a whole number >= 1 (a size)."""
    return _whole(text, 1)


def _nonnegative(text):
    """argparse type: a whole number >= 0 (a seed of NumPy's generators, a count of outliers), checked before
    anything runs."""
    return _whole(text, 0)


def out_problem(text: str | None) -> str | None:
    """Why ``--out`` (a run directory that a command creates) cannot be used, or None: an empty string, a path that
    exists (nothing is written over) or one whose parent cannot be written."""
    if text is None:
        return None
    if not text.strip():
        return "--out must name a directory; got an empty string (leave --out out for the default)"
    out = Path(text)
    if out.exists() or out.is_symlink():
        return f"--out {out} already exists; choose another directory"
    problem = _unwritable_parent(out)
    return f"--out {out}: {problem}" if problem else None


def _unwritable_parent(out: Path) -> str | None:
    """Why the run directory ``out`` cannot be created, or None: its nearest existing ancestor must be a writable
    directory (the report is built beside ``out`` and renamed into place)."""
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None


class _Stop:
    """The stop signal a run received, if any (``_stopped_cleanly_by``)."""

    def __init__(self):
        self.signum = None

    def check(self) -> None:
        """Raise the SystemExit of a signal received so far (again, where it was swallowed)."""
        if self.signum is not None:
            raise SystemExit(128 + self.signum)


@contextlib.contextmanager
def _stopped_cleanly_by(*names):
    """Within the block, the signals ``names`` (SIGTERM, SIGHUP where the platform has them) raise SystemExit, so
    that a run stopped from outside cleans up as an interrupted one does (build_report removes its half-written
    directory on any exception); the previous handlers come back afterwards. Python runs a handler in the main
    thread wherever that thread is, and an exception raised inside a callback from C or a finalizer is printed as
    "ignored" and dropped: a report sent SIGHUP while it compiled ran on to the end and exited 0 (CI at 3a292d8),
    and 3 of 12 SIGHUPs sent to a process compiling Numba functions were dropped in llvmlite's
    ``ExecutionEngine._raw_object_cache_notify``, a ctypes callback for every module compiled. So the block gets the
    signal too (a ``_Stop``), for the caller to ``check`` at its next step."""
    stop = _Stop()

    def handler(signum, frame):
        stop.signum = signum
        raise SystemExit(128 + signum)

    signals = [getattr(signal, name) for name in names if hasattr(signal, name)]
    previous = [signal.signal(sig, handler) for sig in signals]
    try:
        yield stop
    finally:
        for sig, old in zip(signals, previous):
            signal.signal(sig, old)


def _report(args) -> int:
    from .calibrate import cpu_spec
    from .report import SECTIONS, build_report, default_out_dir, planned_steps

    out = args.out if args.out is not None else str(default_out_dir())
    problem = out_problem(out)
    try:  # the predictions price the products at the fp16 rate: a spec without one failed after the measurements
        args.hardware.peak("fp16")
    except ValueError as err:
        problem = problem or f"--hardware {args.hardware.name}: {err}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = Path(out)
    total = 2 + planned_steps(SECTIONS, args.quick)  # the spec, the compiles, the sections' steps (tqdm: an ETA)
    with _stopped_cleanly_by("SIGTERM", "SIGHUP") as stop, tqdm(desc="report", unit="step", total=total,
                                                                file=sys.stderr, disable=args.no_progress) as bar:
        started = []

        def progress(description):  # called as a step starts: the bar counts the steps finished before it
            stop.check()  # a stop signal whose SystemExit was swallowed where it landed
            if started:
                bar.update(1)
            started.append(description)
            bar.set_postfix_str(description)

        progress("calibrating this machine" if args.recalibrate else "this machine's spec")
        cpu = cpu_spec(force=args.recalibrate)
        path = build_report(out, quick=args.quick, seed=args.seed, hardware=args.hardware, cpu=cpu,
                            progress=progress, precompile=True)
        if stop.signum is not None:  # swallowed after the last step: the run still leaves nothing
            shutil.rmtree(path, ignore_errors=True)
            stop.check()
        bar.update(bar.total - bar.n)  # the last step (and any a skipped section did not take)
    print(f"report written to {path / 'index.md'} and {path / 'index.html'}")
    return 0


def _format_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _mb(x):
    return f"{float(x) / 1e6:.2f}"


def _cost_table(named_costs, hw):
    """Per-tensor MB at both levels (SRAM<->L2 / L2<->DRAM), totals, FLOPs, SRAM and the roofline over the levels,
    one column per algorithm."""
    names = list(named_costs)
    tensors = list(dict.fromkeys(t for c in named_costs.values() for t in list(c.reads) + list(c.writes)))
    rows = []
    for tensor in tensors:
        rows.append([f"{tensor} MB L2 / DRAM"] + [
            f"{_mb(int(c.reads.get(tensor, 0)) + int(c.writes.get(tensor, 0)))} / "
            f"{_mb(int(c.dram_reads.get(tensor, 0)) + int(c.dram_writes.get(tensor, 0)))}"
            for c in named_costs.values()])
    timings = {name: c.time(hw) for name, c in named_costs.items()}

    def total_us(name, attribute):
        return f"{sum(float(getattr(k, attribute)) for k in timings[name].kernels) * 1e6:.1f}"

    l2_known = bool(getattr(hw, "l2_bandwidth", 0))
    rows += [["SRAM<->L2 MB"] + [_mb(c.l2_traffic_bytes) for c in named_costs.values()],
             ["L2<->DRAM MB"] + [_mb(c.dram_bytes) for c in named_costs.values()],
             ["DRAM read MB"] + [_mb(c.dram_read_bytes) for c in named_costs.values()],
             ["DRAM write MB"] + [_mb(c.dram_write_bytes) for c in named_costs.values()],
             ["GFLOP executed"] + [f"{float(c.flops) / 1e9:.2f}" for c in named_costs.values()],
             ["SRAM peak KiB"] + [f"{float(c.sram_peak_bytes) / 1024:.1f}" for c in named_costs.values()],
             ["Br x Bc"] + [f"{int(c.params['Br'])}x{int(c.params['Bc'])}" if "Br" in c.params else "-"
                            for c in named_costs.values()],
             ["kernels"] + [str(len(c.kernels)) for c in named_costs.values()],
             ["compute us"] + [total_us(n, "compute_s") for n in names],
             ["L2 us"] + [total_us(n, "l2_s") if l2_known else "n/a" for n in names],
             ["DRAM us"] + [total_us(n, "dram_s") for n in names],
             ["predicted us"] + [f"{float(timings[n].seconds) * 1e6:.1f}" for n in names],
             ["bound"] + ["+".join(sorted({str(k.bound) for k in timings[n].kernels})) for n in names]]
    return _format_table(["", *names], rows)


def _default_tiles(hw, d, elem_bytes) -> str:
    """flash-attn's tiles where flash-attn 2 runs the case (Ampere or newer GPUs, fp16/bf16, head dims up to 256:
    what 'FlashAttention-2' runs there), this library's CPU kernel's on the CPU, the paper's rule elsewhere."""
    from .costs.tile_shapes import FLASH_ATTN_HEAD_DIMS

    if hw.kind == "cpu":
        return "ioaware"
    cc = getattr(hw, "compute_capability", "")
    runs = cc and float(cc) >= 8.0 and elem_bytes == 2 and d <= FLASH_ATTN_HEAD_DIMS[-1]
    return "flash-attn" if runs else "paper"


TILE_REASONS = {"paper": "FlashAttention's Br <= d rule (the analysis, not a shipped kernel)",
                "flash-attn": "the block sizes flash-attn 2.x's forward picks for this head dim and architecture",
                "ioaware": "this library's own kernel's tiles on this machine"}


def _costs(args) -> int:
    from . import costs

    hw = args.hardware
    e = DTYPE_BYTES[args.dtype]
    if args.what == "attention":
        kv_heads = args.kv_heads or args.heads
        if args.heads % kv_heads:
            print(f"error: --heads {args.heads} is not a multiple of --kv-heads {kv_heads}", file=sys.stderr)
            return 2
        shape = (args.batch, args.heads, kv_heads, args.n, args.n, args.d)
        tiles = args.tiles or _default_tiles(hw, args.d, e)
        kw = dict(causal=args.causal, elem_bytes=e, hw=hw, flop_kind=args.dtype)  # the products at --dtype's rate
        named = {"standard": costs.standard_forward(*shape, **kw), "flash1": costs.flash1_forward(*shape, **kw),
                 "flash2": costs.flash2_forward(*shape, tiles=tiles, **kw)}
        title = (f"attention forward, B={args.batch}, heads={args.heads}/{kv_heads}, N={args.n}, d={args.d}, "
                 f"{args.dtype}{', causal' if args.causal else ''}, on {hw.name} (L2 {hw.l2_bytes / 2**20:.0f} MiB)"
                 f"\nflash2 tiles: {tiles} ({TILE_REASONS[tiles]}); flash1: the paper's rule; standard: square "
                 f"GEMM tiles")
    else:
        if args.outliers > args.k:
            print(f"error: --outliers {args.outliers} exceeds the hidden size --k {args.k}", file=sys.stderr)
            return 2
        named = {"dense": costs.dense(args.m, args.k, args.n, elem_bytes=e, flop_kind=args.dtype),
                 "int8_split": costs.int8_split(args.m, args.k, args.n, args.outliers, elem_bytes=e)}
        title = f"matmul {args.m}×{args.k} · {args.k}×{args.n}, {args.outliers} outlier columns, on {hw.name}"
    table = _cost_table(named, hw)  # (raises for a precision the hardware has no rate of: before any output)
    print(title)
    print(table)
    return 0


def _hardware_cmd(args) -> int:
    from .calibrate import cpu_spec
    from .hardware import load, preset_names

    specs = [load(name) for name in preset_names()] + [cpu_spec(force=args.recalibrate)]
    header = ["name", "DRAM GB", "DRAM GB/s", "L2 MiB", "L2 GB/s", "SRAM/SM KiB", "SMs/cores", "fp32 TFLOP/s",
              "fp16 TFLOP/s", "int8 TOP/s", "launch us"]
    rows = [[s.name, f"{s.hbm_bytes / 1e9:.0f}", f"{s.hbm_bandwidth / 1e9:.0f}", f"{s.l2_bytes / 2**20:.0f}",
             f"{s.l2_bandwidth / 1e9:.0f}" if s.l2_bandwidth else "n/a", f"{s.sram_per_sm_bytes / 1024:.0f}",
             s.sm_count, f"{s.fp32_flops / 1e12:.2f}", f"{s.fp16_flops / 1e12:.2f}", f"{s.int8_ops / 1e12:.2f}", f"{s.launch_overhead_s * 1e6:.1f}"]
            for s in specs]
    print(_format_table(header, rows))
    print(f"\n'cpu' was calibrated on {specs[-1].measured_on} (measured, cached; --recalibrate measures again).")
    return 0


def _gpu_check(args) -> int:
    from .gpu_check import PARTS, dry_run, run

    if args.dry_run:
        print(dry_run(PARTS, args.quick, args.deadline_s))
        return 0
    if not args.out:
        print("error: gpu-check needs --out DIR (or --dry-run)", file=sys.stderr)
        return 2

    def progress(text):
        print(text, flush=True)

    return run(Path(args.out), quick=args.quick, deadline_s=args.deadline_s, progress=progress)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ioaware", description="IO-aware kernels beside the bytes they move: measurement, cost model, reports.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    report = commands.add_parser(
        "report", help="measure this machine and write a report (CSV, PNG charts, index.md, index.html)",
        description="Measure standard vs flash attention on this CPU, predict with the cost model, and write a "
                    "report into a run directory.")
    report.add_argument("--quick", action="store_true",
                        help="small sizes: about half a minute on 2 cores once the kernels are compiled")
    report.add_argument("--out", metavar="DIR", help="run directory to create (default: reports/runs/<date>T<time>-cpu)")
    report.add_argument("--hardware", type=_hardware, default=DEFAULT_HARDWARE, metavar="NAME|FILE.toml",
                        help=f"hardware for the predicted sections (default {DEFAULT_HARDWARE})")
    report.add_argument("--seed", type=_nonnegative, default=0, help="seed of the random inputs (default 0)")
    report.add_argument("--recalibrate", action="store_true", help="measure this machine again, ignoring the cache")
    report.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    report.set_defaults(func=_report)

    cost = commands.add_parser("costs", help="one configuration's cost table, algorithms side by side",
                               description="Per-tensor bytes at each level (SRAM<->L2, L2<->DRAM), FLOPs, SRAM and "
                                           "predicted time of each algorithm.")
    what = cost.add_subparsers(dest="what", required=True, metavar="WHAT")
    attn = what.add_parser("attention", help="standard vs FlashAttention-1 vs -2 forward",
                           description="Attention forward: standard vs FlashAttention-1 vs FlashAttention-2.")
    attn.add_argument("--n", type=_positive, required=True, help="sequence length")
    attn.add_argument("--d", type=_positive, default=64, help="head dim (default 64)")
    attn.add_argument("--heads", type=_positive, default=16, help="query heads (default 16)")
    attn.add_argument("--kv-heads", type=_positive, help="key/value heads (GQA; default: --heads)")
    attn.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    attn.add_argument("--causal", action="store_true", help="causal mask")
    attn.add_argument("--tiles", choices=("paper", "flash-attn", "ioaware"),
                      help="FlashAttention-2's tile shapes: the paper's rule, flash-attn's, or this library's kernel's "
                           "(default: flash-attn where flash-attn 2 runs the case: Ampere and newer GPUs, fp16/bf16, "
                           "d <= 256; ioaware on the CPU; else paper)")
    mm = what.add_parser("matmul", help="dense vs LLM.int8() split matmul",
                         description="Y = X·W: dense vs the LLM.int8() split matmul.")
    mm.add_argument("--m", type=_positive, default=1, help="rows of X (tokens; default 1)")
    mm.add_argument("--k", type=_positive, default=4096, help="hidden size (default 4096)")
    mm.add_argument("--n", type=_positive, default=4096, help="output features (default 4096)")
    mm.add_argument("--outliers", type=_nonnegative, default=0, help="outlier columns (default 0)")
    for sub in (attn, mm):
        sub.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp16", help="precision (default fp16)")
        sub.add_argument("--hardware", type=_hardware, default=DEFAULT_HARDWARE, metavar="NAME|FILE.toml",
                         help=f"preset, 'cpu' or a TOML file (default {DEFAULT_HARDWARE})")
        sub.set_defaults(func=_costs)

    hw = commands.add_parser("hardware", help="list the presets and this machine's calibrated spec",
                             description="The hardware presets and this machine's calibrated spec.")
    hw.add_argument("--recalibrate", action="store_true", help="measure this machine again")
    hw.set_defaults(func=_hardware_cmd)

    gpu = commands.add_parser(
        "gpu-check", help="on a CUDA GPU: correctness, benchmarks, DRAM bytes and sanitizers of the GPU kernels",
        description="The one-call GPU check: both GPU tiers against the float64 oracles at real sizes, benchmarks "
                    "beside torch SDPA, cuBLAS and bitsandbytes, Nsight Compute DRAM bytes beside the cost model, "
                    "compute-sanitizer memcheck and racecheck. Needs CuPy and numba-cuda on a CUDA device.")
    gpu.add_argument("--out", metavar="DIR", help="new directory for the CSVs, Markdown, chart and log")
    gpu.add_argument("--quick", action="store_true", help="small sizes; no ncu or sanitizer runs")
    gpu.add_argument("--dry-run", action="store_true", help="list the cases, sizes and estimated times; no GPU")
    gpu.add_argument("--deadline-s", type=_positive, default=420, metavar="S",
                     help="global deadline in seconds, shared among the parts (default 420)")
    gpu.set_defaults(func=_gpu_check)

    from .explain import add_subcommand as add_explain

    add_explain(commands, _hardware, _positive, _nonnegative)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, MemoryError) as err:  # what the library says of bad sizes, files and memory
        print(f"error: {err}", file=sys.stderr)
        return 2
