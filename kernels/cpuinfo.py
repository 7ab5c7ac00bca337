"""This machine as the operating system describes it (cache sizes, processor model; no measurement), and the
user cache directory that the simulator and the models share.

The flash kernels size their tiles from the per-core cache, the CPU's analogue of a GPU's shared memory
(FlashAttention, Dao et al. 2022, Algorithm 1 line 1 sizes the blocks from the on-chip SRAM size M).
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# Used only when the OS tells nothing: 1 MiB is the L2 per core of current x86 server parts
# (AMD Zen 4: 1 MiB, Intel Sapphire Rapids: 2 MiB) and a conservative choice for older ones.
FALLBACK_L2_BYTES = 1 << 20

_SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def _parse_size(text: str) -> int:
    """Parse sysfs sizes such as '1024K' or '32M' into bytes."""
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


@functools.lru_cache(maxsize=None)
def cache_sizes() -> dict[str, int]:
    """Data and unified cache sizes of CPU 0 in bytes, keyed 'L1d', 'L2', 'L3' (those the OS reports).

    Linux sysfs first, then ``os.sysconf``; an empty dict when neither tells.
    """
    sizes: dict[str, int] = {}
    if _SYSFS_CACHE.is_dir():
        for index in sorted(_SYSFS_CACHE.glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
                size = _parse_size((index / "size").read_text())
            except (OSError, ValueError):
                continue
            if kind == "Instruction":
                continue
            sizes["L1d" if level == 1 else f"L{level}"] = size
    if not sizes:
        for name, key in (("SC_LEVEL1_DCACHE_SIZE", "L1d"), ("SC_LEVEL2_CACHE_SIZE", "L2"),
                          ("SC_LEVEL3_CACHE_SIZE", "L3")):
            try:
                value = os.sysconf(name)
            except (ValueError, OSError):
                continue
            if value and value > 0:
                sizes[key] = int(value)
    return sizes


def _cpuinfo_field(key: str) -> str:
    """The first value of ``key`` in Linux ``/proc/cpuinfo`` ("model name", "vendor_id"), else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_vendor() -> str:
    """The processor's vendor string (Linux ``/proc/cpuinfo``'s ``vendor_id``: "GenuineIntel", "AuthenticAMD"),
    else an empty string."""
    return _cpuinfo_field("vendor_id")


def user_cache_dir() -> Path:
    """Where ioaware keeps what it measures or fetches once: ``$IOAWARE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ioaware``, else ``~/.cache/ioaware``."""
    if os.environ.get("IOAWARE_CACHE_DIR"):
        return Path(os.environ["IOAWARE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ioaware"


def l2_bytes() -> int:
    """The per-core L2 size in bytes, or ``FALLBACK_L2_BYTES`` when the OS does not report it."""
    return cache_sizes().get("L2", FALLBACK_L2_BYTES)
