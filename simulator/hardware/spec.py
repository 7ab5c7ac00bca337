"""Hardware specifications: a frozen dataclass, TOML presets beside this file, and user TOML files.

A preset file states every value in the unit its datasheet uses (GB/s, TFLOPS, KiB, ...) with the source in a
comment on the same line; ``HardwareSpec`` holds SI units (bytes, bytes/s, FLOP/s, seconds).
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRESET_DIR = Path(__file__).with_name("presets")
NAME_CHARACTERS = re.compile(r"[\w .,:;()+/@-]")  # what a spec's name may hold (letters, digits, spaces, these
# marks): it goes into the reports' Markdown tables and headings, HTML and TOML, where | < > * ` " \ # and line
# breaks are markup


def safe_name(text: str) -> str:
    """``text`` (a CPU's model string, say) with every character outside ``NAME_CHARACTERS`` made a space and the
    spaces collapsed; real model names ("Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz") keep every character."""
    name = " ".join("".join(c if NAME_CHARACTERS.fullmatch(c) else " " for c in str(text)).split())
    return name[:64].rstrip() or "unknown"  # (x86 brand strings hold 48 characters at most; a name 80)


# Shared memory serves 32 banks × 4 B = 128 B per clock per SM (CUDA programming guide, "Shared Memory"); the
# aggregate SRAM bandwidth is derived from it (FlashAttention §2.1 quotes ~19 TB/s for A100 = 108 × 128 B × 1.41 GHz).
SMEM_BYTES_PER_CLOCK_PER_SM = 32 * 4

# (TOML key, field, factor from the file's unit to SI); the order is the order files are written in
_FIELDS = (
    ("hbm_gb", "hbm_bytes", 1e9),
    ("hbm_gb_per_s", "hbm_bandwidth", 1e9),
    ("l2_mib", "l2_bytes", 2**20),
    ("sram_per_sm_kib", "sram_per_sm_bytes", 2**10),
    ("sm_count", "sm_count", 1),
    ("boost_mhz", "clock_hz", 1e6),
    ("fp32_tflops", "fp32_flops", 1e12),
    ("fp16_tflops", "fp16_flops", 1e12),
    ("bf16_tflops", "bf16_flops", 1e12),
    ("int8_tops", "int8_ops", 1e12),
    ("launch_overhead_us", "launch_overhead_s", 1e-6),
)
# optional keys: a measured SRAM bandwidth (the CPU's caches) instead of the derived one; the shared level's
# (GPU L2, CPU last-level cache) bandwidth where a datasheet or a published microbenchmark gives one (absent or 0:
# not known, and the roofline then has no L2 term); and when it was measured
_OPTIONAL = (("sram_gb_per_s", "sram_bandwidth_measured", 1e9), ("l2_gb_per_s", "l2_bandwidth", 1e9))
# CUDA C++ Programming Guide, "Features and Technical Specifications" table (compute capability 7.5 to 9.0):
# 64 K 32-bit registers per SM, at most 32 resident blocks per SM on 8.0 / 9.0 (16 on 7.5 and 8.6 / 8.9, a bound
# the shared memory reaches first for every tile this model uses)
REGISTERS_PER_SM = 65536
MAX_CTAS_PER_SM = 32
FLOP_KINDS = ("fp32", "fp16", "bf16", "int8")


@dataclass(frozen=True)
class HardwareSpec:
    """One machine's memory hierarchy and peak rates, in SI units.

    Three levels: ``sram_per_sm_bytes`` is the usable on-chip SRAM of one SM (shared memory; on a CPU, one core's
    L2) — the M of FlashAttention's analysis; ``l2_bytes`` and ``l2_bandwidth`` are the level all SMs (cores)
    share — the GPU's L2, the CPU's last-level cache (``l2_bandwidth`` 0: not known); ``hbm_bytes`` and
    ``hbm_bandwidth`` are DRAM (HBM, GDDR or the CPU's DRAM). ``sm_count`` is SMs (GPU) or cores (CPU). A peak
    of 0 means the part lacks that kind (T4 has no BF16).
    """

    name: str
    kind: str  # "gpu" or "cpu"
    hbm_bytes: float
    hbm_bandwidth: float
    l2_bytes: float
    sram_per_sm_bytes: float
    sm_count: int
    clock_hz: float
    fp32_flops: float
    fp16_flops: float
    bf16_flops: float
    int8_ops: float
    launch_overhead_s: float
    sram_bandwidth_measured: float = 0.0
    l2_bandwidth: float = 0.0  # bytes/s between the SMs and the shared level; 0: not known
    compute_capability: str = ""  # "8.0", "9.0", ... (GPU presets; flash-attn picks its tiles by it); "" unknown
    measured_on: str = ""  # ISO date of a calibration (the ``cpu`` spec); empty for datasheet presets

    def __post_init__(self):
        if not isinstance(self.name, str) or not 1 <= len(self.name) <= 80 or not all(
                NAME_CHARACTERS.fullmatch(c) for c in self.name):
            raise ValueError(f"a spec's name must be 1-80 letters, digits, spaces and . , : ; ( ) + / @ - _ (it is "
                             f"printed into Markdown, HTML and TOML); got {self.name!r}")
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"{self.name}: kind must be 'gpu' or 'cpu'; got {self.kind!r}")
        for key, field, _ in _FIELDS:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.name}: {key} must be a finite number >= 0; got {value!r}")
        for key, field in (("l2_gb_per_s", "l2_bandwidth"), ("sram_gb_per_s", "sram_bandwidth_measured")):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.name}: {key} must be a finite number >= 0; got {value!r}")
        if isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int):
            raise ValueError(f"{self.name}: sm_count must be a whole number; got {self.sm_count!r}")
        if self.compute_capability and not re.fullmatch(r"[1-9][0-9]?\.[0-9]", self.compute_capability):
            raise ValueError(f"{self.name}: compute_capability must be major.minor, as \"9.0\"; got "
                             f"{self.compute_capability!r}")
        if self.sram_per_sm_bytes != int(self.sram_per_sm_bytes):  # (100.3 KiB failed later, in the cost model,
            # as "sram_bytes must be a whole number")
            raise ValueError(f"{self.name}: sram_per_sm_kib must be a whole number of bytes; got "
                             f"{self.sram_per_sm_bytes / 2**10:g} KiB ({self.sram_per_sm_bytes:g} bytes)")
        for field in ("hbm_bytes", "hbm_bandwidth", "sram_per_sm_bytes", "sm_count", "fp32_flops"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be > 0; got {getattr(self, field)!r}")

    @property
    def sram_bandwidth(self) -> float:
        """Aggregate SRAM bandwidth in bytes/s: measured (CPU), else 128 B/clock/SM × SMs × boost clock."""
        if self.sram_bandwidth_measured:
            return self.sram_bandwidth_measured
        return SMEM_BYTES_PER_CLOCK_PER_SM * self.sm_count * self.clock_hz

    def ctas_in_flight(self, sram_per_cta, threads_per_cta=None, registers_per_thread=None):
        """How many work units run at once: on a GPU, SMs × the CTAs one SM holds — bounded by its shared memory
        (``sram_per_cta`` bytes each), by ``MAX_CTAS_PER_SM``, and by its registers where the kernel's are known
        (``threads_per_cta`` × ``registers_per_thread`` of ``REGISTERS_PER_SM``); on a CPU, one task per core.
        Arrays broadcast (a sweep)."""
        import numpy as np

        if self.kind == "cpu":
            return np.full(np.shape(sram_per_cta), self.sm_count, dtype=np.int64)[()]
        smem = np.maximum(np.asarray(sram_per_cta, dtype=np.int64), 1)
        per_sm = np.minimum(np.asarray(self.sram_per_sm_bytes, dtype=np.int64) // smem, MAX_CTAS_PER_SM)
        if threads_per_cta is not None and registers_per_thread is not None:
            per_sm = np.minimum(per_sm, REGISTERS_PER_SM // (int(threads_per_cta) * int(registers_per_thread)))
        return (self.sm_count * np.maximum(per_sm, 1))[()]

    def peak(self, flop_kind: str) -> float:
        """Peak FLOP/s (OP/s for int8) of one kind: 'fp32', 'fp16', 'bf16' or 'int8'."""
        if flop_kind not in FLOP_KINDS:
            raise ValueError(f"unknown flop kind {flop_kind!r}; known: {', '.join(FLOP_KINDS)}")
        rate = {"fp32": self.fp32_flops, "fp16": self.fp16_flops, "bf16": self.bf16_flops,
                "int8": self.int8_ops}[flop_kind]
        if rate <= 0:
            raise ValueError(f"{self.name} has no {flop_kind} rate (its spec lists 0)")
        return rate

    def ridge_point(self, flop_kind: str = "fp16") -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns: peak / HBM bandwidth."""
        return self.peak(flop_kind) / self.hbm_bandwidth

    def to_toml(self) -> str:
        """The spec as a TOML file in the presets' units (sources are not known here, so none are written)."""
        lines = [f'name = "{self.name}"', f'kind = "{self.kind}"']
        for key, field, factor in _FIELDS + _OPTIONAL:
            value = getattr(self, field)
            if field in ("sram_bandwidth_measured", "l2_bandwidth") and not value:
                continue
            # 10 significant digits: parsing this text and writing it again gives the same text, so a spec read
            # back from its file equals the one that wrote it (value / factor * factor alone can lose the last bit)
            lines.append(f"{key} = {value if field == 'sm_count' else format(value / factor, '.10g')}")
        if self.compute_capability:
            lines.append(f'compute_capability = "{self.compute_capability}"')
        if self.measured_on:
            lines.append(f'measured_on = "{self.measured_on}"')
        return "\n".join(lines) + "\n"


def from_toml(text: str, origin: str = "<toml>") -> HardwareSpec:
    """Parse a spec from TOML text in the presets' units; missing or unknown keys raise ``ValueError``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{origin}: not valid TOML: {err}") from None
    required = {"name", "kind"} | {key for key, _, _ in _FIELDS}
    optional = {key for key, _, _ in _OPTIONAL} | {"measured_on", "compute_capability"}
    missing = sorted(required - data.keys())
    if missing:
        raise ValueError(f"{origin}: missing field(s) {', '.join(missing)}")
    unknown = sorted(data.keys() - required - optional)
    if unknown:
        raise ValueError(f"{origin}: unknown field(s) {', '.join(unknown)}")
    values = {"name": str(data["name"]), "kind": data["kind"], "measured_on": str(data.get("measured_on", "")),
              "compute_capability": str(data.get("compute_capability", ""))}
    for key, field, factor in _FIELDS + _OPTIONAL:
        if key not in data:
            continue
        raw = data[key]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"{origin}: {key} must be a number; got {raw!r}")
        if raw < 0:
            raise ValueError(f"{origin}: {key} must be >= 0; got {raw!r}")
        if field == "sm_count" and raw != int(raw):
            raise ValueError(f"{origin}: {key} must be a whole number; got {raw!r}")  # (131.9 became 131)
        values[field] = int(raw) if field == "sm_count" else raw * factor
    return HardwareSpec(**values)


def preset_names() -> list[str]:
    """Names of the datasheet presets shipped beside this module."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.toml"))


def load(name_or_path) -> HardwareSpec:
    """A spec by preset name (case-insensitive) or a path to a TOML file (``"cpu"``, this machine, is measured:
    ``simulator.calibrate.cpu_spec()``)."""
    text = str(name_or_path)
    if text.lower() == "cpu":
        raise ValueError("'cpu' is this machine, measured rather than read: simulator.calibrate.cpu_spec() "
                         "calibrates it (and caches the result)")
    path = Path(text)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ValueError(f"hardware file {path} " + ("is a directory" if path.is_dir() else "does not exist"))
        return from_toml(path.read_text(), origin=str(path))
    by_lower = {name.lower(): name for name in preset_names()}
    if text.lower() not in by_lower:
        known = ", ".join(preset_names())
        raise ValueError(f"unknown hardware {text!r}; known: {known} (or a path to a .toml file; 'cpu', this "
                         f"machine, is measured by simulator.calibrate.cpu_spec())")
    preset = PRESET_DIR / f"{by_lower[text.lower()]}.toml"
    return from_toml(preset.read_text(), origin=str(preset))


def replace(spec: HardwareSpec, **changes) -> HardwareSpec:
    """A copy of ``spec`` with some fields changed (for sweeps, e.g. of ``sram_per_sm_bytes``)."""
    return dataclasses.replace(spec, **changes)
