"""The ``Cost`` record: a per-tensor ledger of traffic at two levels, FLOPs and SRAM use, kernel by kernel, and its
roofline over the levels.

Three memories, two boundaries: a tile moves between an SM's SRAM and the shared level (the GPU's L2, the CPU's
last-level cache) — ``reads``/``writes``, every load and store the schedule issues — and a line moves between the
shared level and DRAM — ``dram_reads``/``dram_writes``, the first touches and the re-reads the shared cache did not
keep. Without a shared cache (no ``HardwareSpec`` given to the cost function) every tile transfer reaches DRAM and
the two ledgers are equal. ``dram_bytes`` is the headline; ``hbm_*`` (a GPU's DRAM is its HBM) are its old names.

Sizes may be NumPy arrays (a sweep): every field then holds an array of the broadcast shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from ..hardware.spec import FLOP_KINDS


def _frozen(mapping):
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class KernelCost:
    """One kernel launch (or one launch per batch·head, counted once): bytes per tensor at each level, FLOPs and its
    SRAM peak. ``dram_reads``/``dram_writes`` None: no shared cache, DRAM sees every tile transfer."""

    name: str
    reads: MappingProxyType = field(default_factory=lambda: _frozen({}))  # tensor -> bytes SRAM <- L2 (tile loads)
    writes: MappingProxyType = field(default_factory=lambda: _frozen({}))  # tensor -> bytes SRAM -> L2 (tile stores)
    flops: object = 0.0
    flop_kind: str = "fp16"
    sram_peak_bytes: object = 0
    dram_reads: MappingProxyType | None = None  # tensor -> bytes L2 <- DRAM
    dram_writes: MappingProxyType | None = None  # tensor -> bytes L2 -> DRAM

    @property
    def dram_read_map(self):
        return self.reads if self.dram_reads is None else self.dram_reads

    @property
    def dram_write_map(self):
        return self.writes if self.dram_writes is None else self.dram_writes

    @property
    def l2_read_bytes(self):
        """Bytes the kernel's tile loads bring from the shared level into SRAM."""
        return sum(self.reads.values(), 0)

    @property
    def l2_write_bytes(self):
        return sum(self.writes.values(), 0)

    @property
    def dram_read_bytes(self):
        return sum(self.dram_read_map.values(), 0)

    @property
    def dram_write_bytes(self):
        return sum(self.dram_write_map.values(), 0)

    hbm_read_bytes = dram_read_bytes
    hbm_write_bytes = dram_write_bytes


def kernel(name, *, reads=None, writes=None, flops=0.0, flop_kind="fp16", sram_peak_bytes=0, dram_reads=None,
           dram_writes=None) -> KernelCost:
    """A ``KernelCost``; ``dram_reads``/``dram_writes`` default to the tile traffic (no shared cache). A tensor
    left out of a given DRAM map moves no DRAM bytes. ``flop_kind``: the peak its FLOPs run at (``FLOP_KINDS``)."""
    if flop_kind not in FLOP_KINDS:
        raise ValueError(f"flop_kind must be one of {', '.join(FLOP_KINDS)}; got {flop_kind!r}")
    return KernelCost(name, _frozen(reads or {}), _frozen(writes or {}), flops, flop_kind, sram_peak_bytes,
                      None if dram_reads is None else _frozen(dram_reads),
                      None if dram_writes is None else _frozen(dram_writes))


@dataclass(frozen=True)
class KernelTime:
    name: str
    seconds: object
    compute_s: object
    memory_s: object  # the larger of the two levels' times
    bound: object  # "compute", "dram" or "l2" (an array of them for a sweep)
    dram_s: object = 0.0
    l2_s: object = 0.0


@dataclass(frozen=True)
class RooflineTime:
    """Roofline time: Σ over kernels of max(FLOPs / peak, L2 bytes / L2 bandwidth, DRAM bytes / DRAM bandwidth) + one
    launch overhead each."""

    seconds: object
    kernels: tuple[KernelTime, ...]


@dataclass(frozen=True)
class Cost:
    """What one algorithm moves and computes.

    ``reads``/``writes`` sum the kernels' tile traffic (SRAM <-> L2) per tensor, ``dram_reads``/``dram_writes``
    their DRAM traffic (L2 <-> DRAM); ``l2_*_bytes`` and ``dram_*_bytes`` are the totals (``hbm_*`` = ``dram_*``);
    ``flops`` counts the FLOPs executed (a tiled causal kernel also computes the masked half of diagonal tiles),
    ``useful_flops`` the 2·m·n·k of the products the algorithm needs; ``sram_peak_bytes`` is the largest on-chip
    working set of any kernel.
    """

    algorithm: str
    kernels: tuple[KernelCost, ...]
    useful_flops: object = 0.0
    params: MappingProxyType = field(default_factory=lambda: _frozen({}))

    def _sum(self, attribute):
        totals: dict[str, object] = {}
        for k in self.kernels:
            for tensor, nbytes in getattr(k, attribute).items():
                totals[tensor] = totals.get(tensor, 0) + nbytes
        return _frozen(totals)

    @property
    def reads(self):
        return self._sum("reads")

    @property
    def writes(self):
        return self._sum("writes")

    @property
    def dram_reads(self):
        return self._sum("dram_read_map")

    @property
    def dram_writes(self):
        return self._sum("dram_write_map")

    @property
    def l2_read_bytes(self):
        return sum((k.l2_read_bytes for k in self.kernels), 0)

    @property
    def l2_write_bytes(self):
        return sum((k.l2_write_bytes for k in self.kernels), 0)

    @property
    def l2_traffic_bytes(self):
        """Bytes between the SMs' SRAM and the shared level, both directions (every tile load and store)."""
        return self.l2_read_bytes + self.l2_write_bytes

    @property
    def dram_read_bytes(self):
        return sum((k.dram_read_bytes for k in self.kernels), 0)

    @property
    def dram_write_bytes(self):
        return sum((k.dram_write_bytes for k in self.kernels), 0)

    @property
    def dram_bytes(self):
        """The headline: bytes between the shared level and DRAM, both directions."""
        return self.dram_read_bytes + self.dram_write_bytes

    hbm_read_bytes = dram_read_bytes
    hbm_write_bytes = dram_write_bytes
    hbm_bytes = dram_bytes

    @property
    def flops(self):
        return sum((k.flops for k in self.kernels), 0.0)

    @property
    def sram_peak_bytes(self):
        peaks = [np.asarray(k.sram_peak_bytes) for k in self.kernels]
        return np.maximum.reduce(peaks) if peaks else 0

    def time(self, hw) -> RooflineTime:
        """Roofline time on ``hw`` (a ``HardwareSpec``), a roofline over the levels: per kernel max(FLOPs/peak,
        L2 bytes / L2 bandwidth, DRAM bytes / DRAM bandwidth), plus one launch overhead per kernel (Williams,
        Waterman & Patterson, "Roofline", CACM 2009; the hierarchical roofline of Yang et al., "Hierarchical
        Roofline Analysis for GPUs", 2020). A spec without an L2 bandwidth (0) has no L2 term."""
        from ..hardware import HardwareSpec

        if not isinstance(hw, HardwareSpec):  # (None was an AttributeError)
            raise TypeError(f"hw must be a simulator.hardware.HardwareSpec; got {type(hw).__name__}")
        parts = []
        total = 0.0
        for k in self.kernels:
            compute_s = np.asarray(k.flops, dtype=float) / hw.peak(k.flop_kind)
            dram_s = np.asarray(k.dram_read_bytes + k.dram_write_bytes, dtype=float) / hw.hbm_bandwidth
            l2_bw = getattr(hw, "l2_bandwidth", 0.0)
            l2_s = (np.asarray(k.l2_read_bytes + k.l2_write_bytes, dtype=float) / l2_bw if l2_bw
                    else np.zeros_like(dram_s))
            memory_s = np.maximum(dram_s, l2_s)
            seconds = np.maximum(compute_s, memory_s) + hw.launch_overhead_s
            bound = np.where(compute_s >= memory_s, "compute", np.where(dram_s >= l2_s, "dram", "l2"))
            parts.append(KernelTime(k.name, seconds, compute_s, memory_s, bound[()] if bound.ndim == 0 else bound,
                                    dram_s, l2_s))
            total = total + seconds
        return RooflineTime(total, tuple(parts))
