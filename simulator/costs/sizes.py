"""The one validation of the sizes every cost-model function takes (plain integers or NumPy arrays of them).

A size is a whole number >= its minimum (1 for dimensions, 0 for counts such as outlier dimensions); GQA's query
heads are a multiple of its key/value heads; and every count the model forms must fit its 64-bit integers: the
largest product of a function's sizes is checked against ``LIMIT`` before anything is computed, so that a size
that would wrap around (2^40 tokens, say, gave negative bytes and 0 FLOPs) is refused with the limit instead.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

LIMIT = 2**62  # headroom below int64's 2^63 − 1 for the sums of a few products of this size


def _as_int64(name, value, minimum):
    """``value`` as an int64 array after checking it: whole numbers >= ``minimum``, and within ``LIMIT``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a whole number; got {value!r}")
    array = np.asarray(value)
    if array.dtype == object:  # Python integers beyond 64 bits, or things that are not numbers
        items = array.ravel().tolist()
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in items):
            raise TypeError(f"{name} must be a whole number (or an array of them); got {value!r}")
        biggest = max(items, default=0)
        if biggest > LIMIT:
            raise ValueError(f"{name} = {biggest} is beyond the cost model's 64-bit counts (at most 2^62)")
        array = np.asarray(items, dtype=np.int64).reshape(array.shape)
    elif array.dtype.kind == "b" or array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a whole number (or an array of them); got {array.dtype} {value!r}")
    elif array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.floor(array)):
            bad = array[~(np.isfinite(array) & (array == np.floor(array)))].ravel()[0]
            raise ValueError(f"{name} must be a whole number; got {float(bad)!r}")
    if array.size and np.max(array) > LIMIT:
        raise ValueError(f"{name} = {np.max(array)} is beyond the cost model's 64-bit counts (at most 2^62)")
    array = array.astype(np.int64)
    if array.size and np.min(array) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {np.min(array)}")
    return array


def check_sizes(minimum=1, **sizes):
    """The sizes named by the keywords as int64 arrays (in that order), each a whole number >= ``minimum``."""
    return tuple(_as_int64(name, value, minimum) for name, value in sizes.items())


def check_gqa(Hq, Hkv):
    """Raise unless every Hq is a multiple of its Hkv (the query heads of a group share one key/value head)."""
    if np.any(np.asarray(Hq) % np.asarray(Hkv)):
        raise ValueError(f"Hq must be a multiple of Hkv (grouped-query attention); got Hq={Hq}, Hkv={Hkv}")


def check_product(what: str, *factors):
    """Raise if the product of the factors' largest values, the biggest count a function forms, exceeds ``LIMIT``
    (computed in Python integers, which do not overflow)."""
    biggest = math.prod(int(np.max(f)) if np.size(f) else 0 for f in factors)
    if biggest > LIMIT:
        raise ValueError(f"these sizes make {what} = {biggest:.3g}, beyond the cost model's 64-bit counts "
                         f"(at most 2^62 = {LIMIT:.3g}); use smaller sizes")
