"""The float dtypes every kernel accepts, the precision each computes in, and the checks that name the bad argument
(one message for every algorithm and backend): dtypes, finite values, counts."""
from __future__ import annotations

import numbers

import numpy as np

# float16 is accepted and computed in float32 (its products and sums would overflow or lose too much in float16).
COMPUTE_DTYPE = {np.dtype(np.float16): np.dtype(np.float32),
                 np.dtype(np.float32): np.dtype(np.float32),
                 np.dtype(np.float64): np.dtype(np.float64)}


def check_finite(name: str, x, why: str) -> None:
    """Raise ``ValueError`` naming ``name`` and ``why`` if the array ``x`` (host or device) holds NaN or ±inf; a
    device array is checked on its device."""
    from . import gpu

    if gpu.is_device_array(x):
        from .numba_cuda import all_finite

        finite = all_finite(gpu.to_numba(gpu.contiguous(x)))
    else:
        finite = bool(np.isfinite(x).all())
    if not finite:
        raise ValueError(f"{name} contains NaN or ±inf, {why}")


def check_float_dtype(name: str, x) -> None:
    """Raise ``TypeError`` unless the array ``x`` (host or device) has one of the accepted float dtypes."""
    dtype = np.dtype(x.dtype)
    if dtype not in COMPUTE_DTYPE:
        if dtype.kind == "f" and dtype.newbyteorder("=") in COMPUTE_DTYPE:  # ('>f4': float32, big-endian)
            raise TypeError(f"{name} must be in this machine's byte order; got {dtype.str} ({dtype.name} of the "
                            f"other order): pass {name}.astype({dtype.name})")
        raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64); got {x.dtype}")


def check_int(name: str, value, least: int) -> int:
    """``value`` as a Python int; ``TypeError`` naming ``name`` where it is not an integer (a bool is not; NumPy's
    integers are), ``ValueError`` where it is below ``least``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}; got {value}")
    return int(value)
