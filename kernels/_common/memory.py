"""Refuse work whose predicted memory exceeds what this machine has available, before allocating any of it; and
arrays that a kernel streams on huge pages."""
from __future__ import annotations

import mmap

import numpy as np
import psutil


class InsufficientMemoryError(MemoryError):
    """Raised before a computation starts when its predicted allocation exceeds the available memory."""


def available_bytes() -> int:
    """Memory that can be allocated now without swapping (psutil's ``available``)."""
    return psutil.virtual_memory().available


# Asking the OS costs ~50 us (psutil reads /proc/meminfo), as much as a whole decode step over a pruned cache:
# allocations up to this size are not checked (no machine this library targets lacks 16 MiB).
MIN_CHECKED_BYTES = 16 * 2**20


def copy_bytes(arrays, dtype) -> int:
    """Bytes of the copies ``np.ascontiguousarray(a, dtype)`` makes of ``arrays``: of each one not already
    C-contiguous in ``dtype``."""
    dtype = np.dtype(dtype)
    return sum(a.size * dtype.itemsize for a in arrays if a.dtype != dtype or not a.flags.c_contiguous)


def ensure_fits(predicted_bytes: int, what: str, remedy: str = "") -> None:
    """Raise ``InsufficientMemoryError`` naming ``what``, both sizes and the ``remedy`` if ``predicted_bytes`` will
    not fit."""
    if predicted_bytes <= MIN_CHECKED_BYTES:
        return
    available = available_bytes()
    if predicted_bytes > available:
        raise InsufficientMemoryError(
            f"{what} needs {predicted_bytes / 2**30:.2f} GiB ({predicted_bytes} bytes) but only "
            f"{available / 2**30:.2f} GiB is available" + (f"; {remedy}" if remedy else ""))


HUGE_PAGE_BYTES = 2 * 2**20  # x86-64's large page, mapped by a page-directory entry (Intel SDM vol. 3A, 4.5
# "4-Level Paging": "2-MByte page"; AMD64 APM vol. 2, 5.3.4 "2-Mbyte Page Translation")


def huge_page_empty(n: int, dtype) -> np.ndarray:
    """An uninitialized 1-D array of n elements of ``dtype`` on fresh anonymous memory, its start on a 2 MiB boundary,
    advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``: Linux kernel documentation,
    admin-guide/mm/transhuge.rst); where the OS has no such advice, or the array is smaller than one huge page (a
    first touch would fault in 2 MiB for it), ``np.empty``.

    Why: NumPy asks for huge pages itself on large allocations, but memory that ``malloc`` hands back from its heap
    may have been touched before in 4 KiB pages, and those stay. SmolLM2's int8 decode arena (101 MiB, made after the
    GGUF's float32 tensors were freed) had no huge page at all (``AnonHugePages`` 0 in /proc/self/smaps); a copy of it
    here had every page huge. 2-vCPU AMD EPYC (Zen 4, KVM, nested paging), in turn in one process: an all-core read
    of it 23.0-27.6 -> 28.6-29.6 GB/s over six rounds; the int8 + int8 head decode step 6.57-7.49 -> 6.22-7.06 ms
    over eight rounds of 20 calls, faster in each round. SmolLM2's KV cache at 4000 tokens (91 MiB each for K and V,
    also reused pages), the same step over it: 16.1-21.1 -> 14.8-20.3 ms, faster in seven rounds of eight. The
    mapping is freed when the array and its views are."""
    dtype = np.dtype(dtype)
    n = int(n)
    n_bytes = n * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if n_bytes < HUGE_PAGE_BYTES or advice is None:
        return np.empty(n, dtype=dtype)
    region = mmap.mmap(-1, n_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)  # before the first touch: the pages are huge from their first fault
    except OSError:  # a kernel without transparent huge pages refuses the advice (EINVAL): 4 KiB pages then
        pass
    raw = np.frombuffer(region, dtype=np.uint8)  # holds the mapping
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    return raw[start:start + n_bytes].view(dtype)
