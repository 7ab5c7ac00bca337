"""A memory machine: NumPy arrays play DRAM, a capacity-checked SRAM holds tiles, and every transfer is counted per
tensor and direction and recorded on a timeline; optionally an LRU shared cache (the GPU's L2) sits between them.

``reads``/``writes`` count the tile traffic between SRAM and the shared level — what the cost model's
``reads``/``writes`` count. With ``l2_bytes`` > 0 the machine also records which ``line_bytes`` lines of each tensor
every transfer touches, under the work unit (CTA) and step the schedule names with ``unit()`` and ``step()``, and
``dram_reads``/``dram_writes`` replay them through a write-back, write-allocate LRU cache of ``l2_bytes``: each
kernel's units in launch order, in waves of ``concurrent`` units that advance in lockstep one step at a time (the
schedule ``simulator.costs.reuse`` reasons about). Without a shared cache DRAM sees every transfer.

Values are computed in float64 (so the outputs can be compared with the float64 oracles), but each transfer is
charged at the precision the modelled kernel would use (``elem_bytes``), as the analytic cost model does.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class SramOverflowError(RuntimeError):
    """A schedule tried to hold more on chip than the SRAM has."""


@dataclass(frozen=True)
class Event:
    """One step of the timeline: 'load', 'store', 'alloc', 'free' or 'compute'.

    ``slot`` is the SRAM slot a load fills (its tensor's name by default). ``rows`` and ``cols`` say where a
    transferred tile lies in its tensor, as (start, stop) positions within one (batch, head): ``rows`` along the
    sequence axis (queries of Q, O, S, P and the statistics, keys of K and V), ``cols`` along the keys of S and P;
    None where the schedule did not say.
    """

    op: str
    kernel: str
    name: str
    nbytes: int = 0
    flops: int = 0
    sram_used: int = 0
    slot: str = ""
    rows: tuple | None = None
    cols: tuple | None = None


@dataclass
class Machine:
    """Counts HBM traffic and tracks SRAM occupancy while a schedule runs.

    ``load``/``store`` move a tile between HBM and a named SRAM slot and charge its bytes to a tensor;
    ``alloc`` reserves on-chip space for intermediates (scores, accumulators). A slot keeps its size until it is
    freed or reused under the same name; exceeding ``sram_bytes`` raises ``SramOverflowError``.
    """

    sram_bytes: int
    record_timeline: bool = True
    l2_bytes: int = 0  # the shared cache; 0: none
    concurrent: object = 1  # units in flight: an int, or {kernel name: int}
    line_bytes: int = 32  # L2 <-> DRAM granule (a 32-byte sector; CUDA C++ Best Practices Guide, "Coalesced Access")
    schedule: str = "waves"  # "waves" (GPU CTAs) or "chunks" (CPU threads, each a contiguous share of the units)
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    flops: int = 0
    sram_peak_bytes: int = 0
    timeline: list = field(default_factory=list)
    _slots: dict = field(default_factory=dict)
    _kernel: str = ""
    _accesses: list = field(default_factory=list)  # (kernel, unit, step, is_write, tensor, lines)
    _unit: object = None
    _step: int = 0
    _replayed: tuple | None = None

    def __post_init__(self):
        if self.schedule not in ("waves", "chunks"):
            raise ValueError(f"schedule must be 'waves' or 'chunks'; got {self.schedule!r}")

    def kernel(self, name: str) -> None:
        """Start a new kernel: SRAM does not survive a kernel boundary (the shared cache does)."""
        self._slots.clear()
        self._kernel = name
        self._unit, self._step = None, 0

    def unit(self, uid) -> None:
        """Start work unit ``uid`` (a CTA) of the current kernel, in launch order, at step 0."""
        self._unit, self._step = (self._kernel, uid), 0

    def step(self) -> None:
        """The current unit moves to its next step (one iteration of its inner loop)."""
        self._step += 1

    def _touch(self, tensor, view, elem_bytes, is_write):
        if not self.l2_bytes:
            return
        base = view
        while isinstance(base.base, np.ndarray):
            base = base.base
        item = base.itemsize
        start = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
        index = np.asarray(start, dtype=np.int64)
        for axis, (n, stride) in enumerate(zip(view.shape, view.strides)):
            shape = [1] * view.ndim
            shape[axis] = n
            index = index + (np.arange(n, dtype=np.int64) * (stride // item)).reshape(shape)
        lines = np.unique(index.ravel() * elem_bytes // self.line_bytes)
        self._accesses.append((self._kernel, self._unit, self._step, is_write, tensor, lines))
        self._replayed = None
    @property
    def sram_used(self) -> int:
        return sum(self._slots.values())

    def _hold(self, slot: str, nbytes: int) -> None:
        self._slots[slot] = int(nbytes)
        used = self.sram_used
        if used > self.sram_bytes:
            raise SramOverflowError(f"kernel {self._kernel!r}: {slot} brings the SRAM in use to {used} bytes, "
                                    f"over the {self.sram_bytes} available")
        self.sram_peak_bytes = max(self.sram_peak_bytes, used)

    def _event(self, op, name, nbytes=0, flops=0, slot="", rows=None, cols=None):
        if self.record_timeline:
            self.timeline.append(Event(op, self._kernel, name, int(nbytes), int(flops), self.sram_used, slot,
                                       rows, cols))

    def alloc(self, slot: str, nbytes: int) -> None:
        self._hold(slot, nbytes)
        self._event("alloc", slot, nbytes)

    def free(self, slot: str) -> None:
        self._slots.pop(slot, None)
        self._event("free", slot)

    def load(self, tensor: str, tile, elem_bytes: int, slot: str | None = None, rows=None, cols=None):
        """Copy ``tile`` (a view of an HBM array) into SRAM slot ``slot`` (default: the tensor's name); ``rows``
        and ``cols`` (see ``Event``) only label the timeline."""
        nbytes = int(tile.size) * elem_bytes
        self._hold(slot or tensor, nbytes)
        self._touch(tensor, tile, elem_bytes, False)
        self.reads[tensor] = self.reads.get(tensor, 0) + nbytes
        self._event("load", tensor, nbytes, slot=slot or tensor, rows=rows, cols=cols)
        return tile.copy()

    def store(self, tensor: str, destination, value, elem_bytes: int, rows=None, cols=None) -> None:
        """Write ``value`` from SRAM into ``destination`` (a view of an HBM array); ``rows``, ``cols`` as ``load``."""
        destination[...] = value
        self._touch(tensor, destination, elem_bytes, True)
        nbytes = int(destination.size) * elem_bytes
        self.writes[tensor] = self.writes.get(tensor, 0) + nbytes
        self._event("store", tensor, nbytes, rows=rows, cols=cols)

    def compute(self, what: str, flops: int) -> None:
        self.flops += int(flops)
        self._event("compute", what, flops=flops)

    def _order(self):
        """The accesses in the order the shared cache sees them: per kernel, accesses outside any unit in program
        order; the units' in waves of ``concurrent`` consecutive units, lockstep by step within a wave — or, with
        ``schedule="chunks"``, ``concurrent`` threads each taking a contiguous share of the units (Numba's static
        prange schedule), the threads' current units in lockstep by step."""
        out, i, acc = [], 0, self._accesses
        while i < len(acc):
            kernel, unit = acc[i][0], acc[i][1]
            j = i
            while j < len(acc) and acc[j][0] == kernel and (acc[j][1] is None) == (unit is None):
                j += 1
            if unit is None:
                out.extend(acc[i:j])
            else:
                c = self.concurrent.get(kernel, 1) if isinstance(self.concurrent, dict) else self.concurrent
                by_unit = OrderedDict()
                for a in acc[i:j]:
                    by_unit.setdefault(a[1], []).append(a)
                units = list(by_unit.values())
                c = max(1, int(c))
                if self.schedule == "chunks":  # round r runs the r-th unit of every thread's share together
                    share = -(-len(units) // c)
                    shares = [units[t * share:(t + 1) * share] for t in range(c)]
                    groups = [[sh[r] for sh in shares if r < len(sh)] for r in range(share)]
                else:
                    groups = [units[w:w + c] for w in range(0, len(units), c)]
                for wave in groups:
                    steps = max(a[2] for u in wave for a in u)
                    per_step = [[[] for _ in range(steps + 1)] for _ in wave]
                    for k, u in enumerate(wave):
                        for a in u:
                            per_step[k][a[2]].append(a)
                    for s in range(steps + 1):
                        for k in range(len(wave)):
                            out.extend(per_step[k][s])
            i = j
        return out

    def _replay(self):
        if self._replayed is None:
            reads, writes, cache = {}, {}, OrderedDict()
            capacity = self.l2_bytes // self.line_bytes

            def evict():
                while len(cache) > capacity:
                    (tensor, _), dirty = cache.popitem(last=False)
                    if dirty:
                        writes[tensor] = writes.get(tensor, 0) + self.line_bytes

            for _, _, _, is_write, tensor, lines in self._order():
                for line in lines.tolist():
                    key = (tensor, line)
                    if key in cache:
                        cache.move_to_end(key)
                        cache[key] = cache[key] or is_write
                    else:
                        if not is_write:  # a full-sector write allocates without a fill
                            reads[tensor] = reads.get(tensor, 0) + self.line_bytes
                        cache[key] = is_write
                        evict()
            for (tensor, _), dirty in cache.items():  # what is dirty at the end goes back to DRAM
                if dirty:
                    writes[tensor] = writes.get(tensor, 0) + self.line_bytes
            self._replayed = (reads, writes)
        return self._replayed

    @property
    def dram_reads(self) -> dict:
        """Bytes per tensor the shared cache fetched from DRAM (every tile load without one)."""
        return dict(self._replay()[0]) if self.l2_bytes else dict(self.reads)

    @property
    def dram_writes(self) -> dict:
        return dict(self._replay()[1]) if self.l2_bytes else dict(self.writes)

    @property
    def l2_read_bytes(self) -> int:
        """Tile loads, SRAM <- shared level."""
        return sum(self.reads.values())

    @property
    def l2_write_bytes(self) -> int:
        return sum(self.writes.values())

    @property
    def dram_read_bytes(self) -> int:
        return sum(self.dram_reads.values())

    @property
    def dram_write_bytes(self) -> int:
        return sum(self.dram_writes.values())

    hbm_read_bytes = dram_read_bytes
    hbm_write_bytes = dram_write_bytes
