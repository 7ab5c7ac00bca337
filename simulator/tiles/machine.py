"""A two-level memory machine: NumPy arrays play HBM, a capacity-checked SRAM holds tiles, and every transfer is
counted per tensor and direction and recorded on a timeline.

Values are computed in float64 (so the outputs can be compared with the float64 oracles), but each transfer is
charged at the precision the modelled kernel would use (``elem_bytes``), as the analytic cost model does.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    flops: int = 0
    sram_peak_bytes: int = 0
    timeline: list = field(default_factory=list)
    _slots: dict = field(default_factory=dict)
    _kernel: str = ""

    def kernel(self, name: str) -> None:
        """Start a new kernel: SRAM does not survive a kernel boundary."""
        self._slots.clear()
        self._kernel = name

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
        self.reads[tensor] = self.reads.get(tensor, 0) + nbytes
        self._event("load", tensor, nbytes, slot=slot or tensor, rows=rows, cols=cols)
        return tile.copy()

    def store(self, tensor: str, destination, value, elem_bytes: int, rows=None, cols=None) -> None:
        """Write ``value`` from SRAM into ``destination`` (a view of an HBM array); ``rows``, ``cols`` as ``load``."""
        destination[...] = value
        nbytes = int(destination.size) * elem_bytes
        self.writes[tensor] = self.writes.get(tensor, 0) + nbytes
        self._event("store", tensor, nbytes, rows=rows, cols=cols)

    def compute(self, what: str, flops: int) -> None:
        self.flops += int(flops)
        self._event("compute", what, flops=flops)

    @property
    def hbm_read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def hbm_write_bytes(self) -> int:
        return sum(self.writes.values())
