"""Argument checks shared by every attention backend, so that the same bad call raises the same error everywhere."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .._common.dtypes import COMPUTE_DTYPE, check_float_dtype
from .._common.gpu import is_device_array


def _check_array(name, x):
    if not (isinstance(x, np.ndarray) or is_device_array(x)) or isinstance(x, np.matrix):  # (a matrix stays 2-D
        # when indexed: "not enough values to unpack")
        raise TypeError(f"{name} must be a numpy.ndarray or a device array (__cuda_array_interface__); "
                        f"got {type(x).__name__}")
    check_float_dtype(name, x)
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{name} must have 2, 3 or 4 dimensions ((N, d), (H, N, d) or (B, H, N, d)); "
                         f"got shape {x.shape}")


def check_block(name, value):
    """A block size is None (choose from the machine) or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 or None; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def check_scale(scale, d):
    """``scale`` defaults to 1/sqrt(d) (Vaswani et al. 2017, eq. 1); otherwise a finite number > 0."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be finite and > 0; got {scale}")
    return scale


def validate(q, k, v, *, causal, scale, block_q, block_k):
    """Check the arguments of an attention call (host or device arrays alike); returns the scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    on_device = [is_device_array(x) for x in (q, k, v)]
    if any(on_device) and not all(on_device):
        raise TypeError("q, k and v must all be NumPy arrays or all device arrays; got "
                        + ", ".join(f"{n} {'on the device' if d else 'in NumPy'}" for n, d in zip("qkv", on_device)))
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)  # device arrays' shapes as tuples
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k and v must have the same number of dimensions; got shapes q {q_shape}, "
                         f"k {k_shape}, v {v_shape}")
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape; got k {k_shape}, v {v_shape}")
    d = q_shape[-1]
    if k_shape[-1] != d:
        raise ValueError(f"head dims differ: q has d={d} (last axis), k and v have d={k_shape[-1]}")
    if d < 1:
        raise ValueError(f"the head dim (last axis of q) must be >= 1; got {d}")
    if q.ndim == 4 and q_shape[0] != k_shape[0]:
        raise ValueError(f"batch sizes differ: q has B={q_shape[0]}, k and v have B={k_shape[0]}")
    if q.ndim >= 3:
        Hq, Hkv = q_shape[-3], k_shape[-3]
        if Hkv < 1 or Hq % Hkv != 0:
            raise ValueError(f"the number of query heads must be a multiple of the number of key/value heads "
                             f"(GQA); got Hq={Hq}, Hkv={Hkv}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    return check_scale(scale, d)


def normalize(q, k, v, *, causal, scale, block_q, block_k):
    """Validate the NumPy inputs and view them as C-contiguous (B, H, N, d) arrays in the compute dtype.

    Returns ``(q4, k4, v4, scale, q_shape)``; ``q_shape`` is the shape of the output.
    """
    scale = validate(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    return (*as_compute_4d(q, k, v), scale, q.shape)


def as_compute_4d(q, k, v):
    """Validated NumPy q, k, v as C-contiguous (B, H, N, d) arrays in the compute dtype."""
    compute = COMPUTE_DTYPE[q.dtype]

    def as4d(x):
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # (B, H, N, d)
        return np.ascontiguousarray(x, dtype=compute)

    return as4d(q), as4d(k), as4d(v)
