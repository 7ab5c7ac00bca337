"""The ``Cost`` record: a per-tensor ledger of HBM traffic, FLOPs and SRAM use, kernel by kernel, and its roofline.

Sizes may be NumPy arrays (a sweep): every field then holds an array of the broadcast shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np


def _frozen(mapping):
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class KernelCost:
    """One kernel launch (or one launch per batch·head, counted once): bytes per tensor, FLOPs and its SRAM peak."""

    name: str
    reads: MappingProxyType = field(default_factory=lambda: _frozen({}))  # tensor -> HBM bytes read
    writes: MappingProxyType = field(default_factory=lambda: _frozen({}))  # tensor -> HBM bytes written
    flops: object = 0.0
    flop_kind: str = "fp16"
    sram_peak_bytes: object = 0

    @property
    def hbm_read_bytes(self):
        return sum(self.reads.values(), 0)

    @property
    def hbm_write_bytes(self):
        return sum(self.writes.values(), 0)


def kernel(name, *, reads=None, writes=None, flops=0.0, flop_kind="fp16", sram_peak_bytes=0) -> KernelCost:
    return KernelCost(name, _frozen(reads or {}), _frozen(writes or {}), flops, flop_kind, sram_peak_bytes)


@dataclass(frozen=True)
class KernelTime:
    name: str
    seconds: object
    compute_s: object
    memory_s: object
    bound: object  # "compute" or "memory" (an array of them for a sweep)


@dataclass(frozen=True)
class RooflineTime:
    """Roofline time: Σ over kernels of max(FLOPs / peak, bytes / bandwidth) + one launch overhead each."""

    seconds: object
    kernels: tuple[KernelTime, ...]


@dataclass(frozen=True)
class Cost:
    """What one algorithm moves and computes.

    ``reads``/``writes`` sum the kernels' ledgers per tensor; ``hbm_read_bytes``/``hbm_write_bytes`` are the totals;
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
    def hbm_read_bytes(self):
        return sum((k.hbm_read_bytes for k in self.kernels), 0)

    @property
    def hbm_write_bytes(self):
        return sum((k.hbm_write_bytes for k in self.kernels), 0)

    @property
    def hbm_bytes(self):
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def flops(self):
        return sum((k.flops for k in self.kernels), 0.0)

    @property
    def sram_peak_bytes(self):
        peaks = [np.asarray(k.sram_peak_bytes) for k in self.kernels]
        return np.maximum.reduce(peaks) if peaks else 0

    def time(self, hw) -> RooflineTime:
        """Roofline time on ``hw`` (a ``HardwareSpec``): per kernel max(FLOPs/peak, bytes/HBM bandwidth), plus one
        launch overhead per kernel (Williams, Waterman & Patterson, "Roofline", CACM 2009)."""
        parts = []
        total = 0.0
        for k in self.kernels:
            compute_s = np.asarray(k.flops, dtype=float) / hw.peak(k.flop_kind)
            memory_s = np.asarray(k.hbm_read_bytes + k.hbm_write_bytes, dtype=float) / hw.hbm_bandwidth
            seconds = np.maximum(compute_s, memory_s) + hw.launch_overhead_s
            bound = np.where(compute_s >= memory_s, "compute", "memory")
            parts.append(KernelTime(k.name, seconds, compute_s, memory_s, bound[()] if bound.ndim == 0 else bound))
            total = total + seconds
        return RooflineTime(total, tuple(parts))
