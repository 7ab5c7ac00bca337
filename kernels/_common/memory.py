"""Refuse work whose predicted memory exceeds what this machine has available, before allocating any of it."""
from __future__ import annotations

import psutil


class InsufficientMemoryError(MemoryError):
    """Raised before a computation starts when its predicted allocation exceeds the available memory."""


def available_bytes() -> int:
    """Memory that can be allocated now without swapping (psutil's ``available``)."""
    return psutil.virtual_memory().available


# Asking the OS costs ~50 us (psutil reads /proc/meminfo), as much as a whole decode step over a pruned cache:
# allocations up to this size are not checked (no machine this library targets lacks 16 MiB).
MIN_CHECKED_BYTES = 16 * 2**20


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
