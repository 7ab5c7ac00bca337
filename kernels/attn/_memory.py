"""Refuse work whose predicted memory exceeds what this machine has available, before allocating any of it."""
from __future__ import annotations

import psutil


class InsufficientMemoryError(MemoryError):
    """Raised before a computation starts when its predicted allocation exceeds the available memory."""


def available_bytes() -> int:
    """Memory that can be allocated now without swapping (psutil's ``available``)."""
    return psutil.virtual_memory().available


def ensure_fits(predicted_bytes: int, what: str) -> None:
    """Raise ``InsufficientMemoryError`` naming ``what`` and both sizes if ``predicted_bytes`` will not fit."""
    available = available_bytes()
    if predicted_bytes > available:
        raise InsufficientMemoryError(
            f"{what} needs {predicted_bytes / 2**30:.2f} GiB ({predicted_bytes} bytes) but only "
            f"{available / 2**30:.2f} GiB is available; use algorithm='flash', which needs O(N·d)")
