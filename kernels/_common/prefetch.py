"""A software prefetch for Numba CPU code: ``llvm.prefetch`` (LLVM Language Reference, "'llvm.prefetch'
Intrinsic"; on x86 ``PREFETCHT0`` or ``PREFETCHT1``, Intel SDM vol. 2B, "PREFETCHh"), which asks for the cache
line holding an array element and returns at once.

Why: the cores' hardware stream prefetchers follow a stream within one 4 KiB page only (Intel 64 and IA-32
Architectures Optimization Reference Manual, "Data Prefetching": the L2 streamer "detects and maintains up to 32
streams of data accesses ... within a 4K page"), so a kernel that reads weight rows at DRAM speed stalls at each
page it enters until the prefetcher has seen enough misses there to restart. Asking for the rows a few groups ahead
keeps the next page's lines in flight. A thread with nothing to do until the others finish can also ask for the
data of its next task, so that the memory keeps streaming while it waits (``kernels.decode``'s token step).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba import njit
from numba.extending import intrinsic


def _prefetch_codegen(locality):
    """The code of ``llvm.prefetch`` (read, data cache) of an array element, at LLVM's temporal ``locality``: 3 is
    x86's ``PREFETCHT0`` (every level), 2 ``PREFETCHT1`` (L2 and out, not L1)."""
    def codegen(context, builder, signature, args):
        array_value, index_value = args
        index_value = context.cast(builder, index_value, signature.args[1], types.intp)
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, array_value)
        if array_type.ndim == 1:
            pointer = cgutils.get_item_pointer(context, builder, array_type, ary, [index_value], wraparound=False)
        else:  # a C-contiguous array: its flat index
            pointer = builder.gep(ary.data, [index_value])
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        # read (0), the locality, data cache (1)
        builder.call(fn, [builder.bitcast(pointer, byte_pointer), ir.Constant(i32, 0), ir.Constant(i32, locality),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return codegen


def _prefetchable(array):
    """A 1-D array (indexed as such), or a C-contiguous one of any shape (indexed by its flat index)."""
    return isinstance(array, types.Array) and (array.ndim == 1 or array.layout == "C")


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line of ``array[index]`` (a 1-D array; or ``array.flat[index]`` of a C-contiguous one) to be
    read into all cache levels; no effect on the program's values, and an address past the array's end is harmless
    (a prefetch never faults)."""
    if not _prefetchable(array):
        return None
    return types.none(array, types.intp), _prefetch_codegen(3)


@intrinsic
def prefetch_l2(typingctx, array, index):
    """``prefetch`` into L2 and the levels beyond it, not L1 (``PREFETCHT1``): for lines asked for well before
    they are read, which would only crowd the small L1 meanwhile."""
    if not _prefetchable(array):
        return None
    return types.none(array, types.intp), _prefetch_codegen(2)


CACHE_LINE_BYTES = 64  # x86 (Intel SDM vol. 3A, "Cache Line Size"; AMD64 APM vol. 2, "Cache Organization")
PREFETCH_ROWS = 8  # a row kernel asks for the weight rows this far ahead of the ones it reads: two groups of four,
# 4.6 KB at K = 576 int8, enough to keep the ~2 KB that one core must have in flight to stream at ~20 GB/s against
# a ~100 ns DRAM latency (Little's law) across the page boundaries. Measured on SmolLM2's int8 decode step (2-vCPU
# Xeon, KVM, alternating fresh processes): the step alone 7.2-7.8 ms without, 5.6-6.7 ms with (the LM head's 28 MB
# 1.4 -> 0.84-0.94 ms); ``generate`` 124-137 -> 139-200 tokens/s. The float32 rows (2.3 KB each at K = 576, so
# four rows fill two pages) lost 5% (21.5-21.9 ms without, 22.7-22.9 with): ``kernels.dense.gemv_rows`` does not
# prefetch


def row_prefetch_rows(vendor: str) -> int:
    """How far ahead (rows) the int8 row kernel (``kernels.int8.rows``) asks for its weight rows on a CPU of
    ``vendor`` (``kernels.cpuinfo.cpu_vendor``); 0: not at all, the hardware prefetchers alone. The panel kernel
    (``kernels.int8.panels``) takes the same value, for the same bytes ahead (not measured there).

    Measured on both vendors the project has run on. Intel (2-vCPU Xeon, family 6 model 167): PREFETCH_ROWS ahead,
    as measured there (above). AMD (2-vCPU EPYC, family 25 model 17, Zen 4, KVM): none. There the four streams of
    consecutive rows (one per quarter of a range) are followed by the hardware prefetchers, and asking for the rows
    as well slowed them: one thread, 300 MB of int8 (N, K) weights from DRAM, 2 rounds each, K = 576 24.5-26.1 GB/s
    without, 12.2-18.5 with PREFETCH_T0 at 1-16 KB ahead per stream, 17.7-22.6 with PREFETCH_T1; K = 1536 21.9-22.1
    without, 11.7-17.5 and 16.9-22.5. Four adjacent rows (one stream) were the other way round there: 8.7-10.3
    without, 10.6-15.7 with. Other vendors: as Intel (the page-bound stream prefetcher that the prefetch is for is
    Intel's documented behaviour)."""
    return 0 if vendor == "AuthenticAMD" else PREFETCH_ROWS


@njit(inline="always")
def prefetch_lines(flat, start, stop):
    """``prefetch`` every cache line of flat[start:stop] (element indices of a 1-D array, or flat ones of a
    C-contiguous array)."""
    step = max(1, CACHE_LINE_BYTES // flat.itemsize)
    for i in range(start, stop, step):
        prefetch(flat, i)


@njit(inline="always")
def prefetch_rows(flat, K, n, n1, rows):
    """Ask for rows n .. min(n + rows, n1) − 1 of a C-contiguous (N, K) array: the array itself, or a flat view
    ``flat`` the caller made once (``w.reshape(-1)``), never one per call: a view made per call is a reference
    counted on the array's shared record, an atomic update of a line that every thread reading the array also
    updates (made per four rows, the int8 rows ran 15% slower on two threads: 4.3 against 3.7 ms over SmolLM2's
    weights)."""
    prefetch_lines(flat, n * K, min(n + rows, n1) * K)
