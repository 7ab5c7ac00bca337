"""Hostile and careless calls of the public functions, for ``tests/test_hostile.py``: for each function its valid
arguments, and for each argument its bad values. A case passes when the call raises ``ValueError`` or ``TypeError``
(or ``kernels.InsufficientMemoryError``) whose message names the argument, or returns what the float64 oracle
returns (NaN and ±inf in attention's inputs have a documented result). Run by ``run(first)`` in a child process,
one JSON line a case, so that a crash cannot take the test process down.
"""
from __future__ import annotations

import json
import sys

import numpy as np

# values of each kind of argument that no function should take silently
BAD_ARRAYS = ("None", "list", "int32", "bool", "complex128", "object", "0-d", "1-d", "5-d", "empty")
BAD_INTS = {"None": None, "-1": -1, "0": 0, "1.5": 1.5, "str": "3", "True": True, "2**70": 2**70, "nan": float("nan")}
BAD_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-1": -1.0, "str": "x", "None": None}
BAD_CHOICES = {"bogus": "bogus", "None": None, "3": 3}


def _spoil(array, how):
    """``array`` made bad in the way ``how`` names (see BAD_ARRAYS)."""
    if how == "None":
        return None
    if how == "list":
        return array.tolist()
    if how in ("int32", "bool", "complex128", "object"):
        return array.astype(how)
    if how == "0-d":
        return np.float32(1.0)
    if how == "1-d":
        return array.reshape(-1)
    if how == "5-d":
        return array[None]
    if how == "empty":
        return array[..., :0]
    raise ValueError(how)


def cases():
    """(case id, function, args, kwargs, argument name the error must name, oracle or None)."""
    import kernels
    from kernels import dense, int8, kvprune
    from simulator import costs

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 40, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    w = rng.standard_normal((8, 32)).astype(np.float32)
    out = []

    def array_cases(fname, fn, args, kwargs, names, skip=()):
        for position, name in enumerate(names):
            for label in (b for b in BAD_ARRAYS if b not in skip):
                bad = list(args)
                bad[position] = _spoil(args[position], label)
                out.append((f"{fname}:{name}={label}", fn, tuple(bad), kwargs, name, None))

    def keyword_cases(fname, fn, args, kwargs, name, bad_values):
        for label, value in bad_values.items():
            out.append((f"{fname}:{name}={label}", fn, args, {**kwargs, name: value}, name, None))

    attention = kernels.attention
    array_cases("attention", attention, (q, k, v), {}, ("q", "k", "v"))
    # (None means the default tile; sizes beyond N are clamped to N: "any size >= 1 works")
    for name in ("block_q", "block_k"):
        keyword_cases("attention", attention, (q, k, v), {}, name, {l: b for l, b in BAD_INTS.items()
                                                                     if l not in ("None", "2**70")})
    keyword_cases("attention", attention, (q, k, v), {}, "scale", {l: b for l, b in BAD_FLOATS.items()
                                                                   if b is not None})
    for name in ("algorithm", "backend"):
        keyword_cases("attention", attention, (q, k, v), {}, name, BAD_CHOICES)
    for name, array in (("q", q), ("k", k), ("v", v)):
        for label, value in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
            bad = array.copy()
            bad[0, 1, 7, 3] = value
            args = {"q": q, "k": k, "v": v, name: bad}
            for causal in (False, True):
                out.append((f"attention:{name}={label},causal={causal}", attention, (args["q"], args["k"], args["v"]),
                            {"causal": causal}, name, "attention-oracle"))
    # vectors of any rank, along any valid axis, are quantize_vectorwise's input; x (..., K) of any rank int8_matmul's
    vectors = ("1-d", "5-d", "empty")
    array_cases("quantize_vectorwise", int8.quantize_vectorwise, (x,), {}, ("x",), skip=vectors)
    keyword_cases("quantize_vectorwise", int8.quantize_vectorwise, (x,), {}, "axis",
                  {l: b for l, b in BAD_INTS.items() if l not in ("-1", "0")})
    array_cases("int8_matmul", int8.int8_matmul, (x, w), {}, ("x", "w"), skip=("5-d",))
    keyword_cases("int8_matmul", int8.int8_matmul, (x, w), {}, "threshold",
                  {l: b for l, b in BAD_FLOATS.items() if l != "inf"})  # inf: no outlier dimension, pure int8
    for label, value in (("nan", np.nan), ("inf", np.inf), ("7e4", 7e4)):
        bad = x.copy()
        bad[1, 2] = value
        out.append((f"int8_matmul:x={label}", int8.int8_matmul, (bad, w), {}, "x", None))
    array_cases("Int8Linear.from_float", int8.Int8Linear.from_float, (w,), {}, ("w",))
    array_cases("matmul_nt", dense.matmul_nt, (x, w), {}, ("x", "w"))
    for fname, fn in (("snapkv_compress", kvprune.snapkv_compress), ("streaming_llm", kvprune.streaming_llm),
                      ("h2o", kvprune.h2o), ("uniform_random", kvprune.uniform_random)):
        array_cases(fname, fn, (q, k, v), {"capacity": 16}, ("q", "k", "v"))
        # (a capacity beyond N keeps the whole prompt: a valid call)
        keyword_cases(fname, fn, (q, k, v), {}, "capacity", {l: b for l, b in BAD_INTS.items() if l != "2**70"})
        out.append((f"{fname}:q=longer", fn, (np.concatenate([q, q[:, :, :1]], axis=2), k, v), {"capacity": 16},
                    "q", None))  # more queries than keys: h2o wrote out of bounds before
    snap = {"capacity": 16, "window": 8}
    keyword_cases("snapkv_compress", kvprune.snapkv_compress, (q, k, v), {"capacity": 16}, "window",
                  {l: b for l, b in BAD_INTS.items() if l != "None"})
    keyword_cases("snapkv_compress", kvprune.snapkv_compress, (q, k, v), snap, "kernel_size", BAD_INTS)
    for name in ("pooling", "gqa"):
        keyword_cases("snapkv_compress", kvprune.snapkv_compress, (q, k, v), snap, name, BAD_CHOICES)
    keyword_cases("h2o_scores", kvprune.h2o_scores, (q, k), {}, "block",
                  {l: b for l, b in BAD_INTS.items() if l != "2**70"})  # (more rows than N: the whole prompt)
    for label, value in (("nan", np.nan), ("inf", np.inf)):
        bad = k.copy()
        bad[0, 1, 5, 2] = value
        for fname, fn in (("snapkv_compress", kvprune.snapkv_compress), ("h2o", kvprune.h2o)):
            out.append((f"{fname}:k={label}", fn, (q, bad, v), {"capacity": 16}, "k", None))
    array_cases("snapkv_scores", kvprune.snapkv_scores, (q[:, :, -8:], k), {}, ("q_window", "k"))
    keyword_cases("snapkv_scores", kvprune.snapkv_scores, (q[:, :, -8:], k), {}, "kernel_size", BAD_INTS)
    scores = rng.standard_normal((2, 3, 40))
    array_cases("top_positions", kvprune.top_positions, (scores, 8), {}, ("scores",),
                skip=("1-d", "5-d", "empty"))  # (positions along the last axis of any rank; an empty row keeps none)
    for label, value in {l: b for l, b in BAD_INTS.items() if l not in ("0", "2**70")}.items():
        out.append((f"top_positions:n_keep={label}", kvprune.top_positions, (scores, value), {}, "n_keep", None))
    nan_scores = scores.copy()
    nan_scores[1, 2, 5] = np.nan
    out.append(("top_positions:scores=nan", kvprune.top_positions, (nan_scores, 8), {}, "scores", None))
    x_i8 = rng.integers(-127, 128, (3, 32), dtype=np.int8)
    w_i8 = rng.integers(-127, 128, (8, 32), dtype=np.int8)
    for label, bad in (("None", None), ("float32", x.copy()), ("1-d", x_i8.reshape(-1)), ("K-mismatch",
                                                                                          x_i8[:, :31])):
        out.append((f"int8_gemm:x_i8={label}", int8.int8_gemm, (bad, w_i8), {}, "x_i8", None))
    # a weight made of the caller's arrays: the kernels read them as raw rows (a short absmax was read past its end)
    absmax = np.abs(w).max(axis=1).astype(np.float32)  # (8,)
    array_cases("Int8Weight", int8.Int8Weight, (w_i8, absmax), {}, ("w_i8",))
    array_cases("Int8Weight", lambda a, w_i8: int8.Int8Weight(w_i8, a), (absmax, w_i8), {}, ("absmax",),
                skip=("1-d",))  # (it is one already)
    for label, bad in (("short", absmax[:1]), ("negative", -absmax), ("nan", np.full_like(absmax, np.nan))):
        out.append((f"Int8Weight:absmax={label}", int8.Int8Weight, (w_i8, bad), {}, "absmax", None))
    for name, args in (("w_fp16", (w_i8, absmax, w[:, :31].astype(np.float16))),
                       ("w_row_sums", (w_i8, absmax, None, np.zeros(3, np.int32))),
                       ("w_row_sums", (w_i8, absmax, None, np.zeros(8, np.int64)))):
        out.append((f"Int8Weight:{name}={args[-1].dtype}{args[-1].shape}", int8.Int8Weight, args, {}, name, None))
    from simulator import tiles

    q64, k64 = q.astype(np.float64)[:, :, :16], k.astype(np.float64)[:, :, :16]
    for name in ("Br", "Bc", "sram_bytes"):
        for label, value in BAD_INTS.items():
            if label == "2**70" and name != "sram_bytes":
                continue  # (a tile beyond N is clamped to N)
            kwargs = {"Br": 8, "Bc": 8, "sram_bytes": 2**20, name: value}
            out.append((f"tiles.flash2_forward:{name}={label}", tiles.flash2_forward, (q64, k64, k64), kwargs, name,
                        None))
    for label, value in BAD_INTS.items():  # the shared cache: 0 is none, so only the rest are bad
        if label not in ("0", "2**70"):
            kwargs = {"Br": 8, "Bc": 8, "sram_bytes": 2**20, "l2_bytes": value}
            out.append((f"tiles.flash2_forward:l2_bytes={label}", tiles.flash2_forward, (q64, k64, k64), kwargs,
                        "l2_bytes", None))
        if label != "2**70":
            kwargs = {"Br": 8, "Bc": 8, "sram_bytes": 2**20, "l2_bytes": 4096, "concurrent": value}
            out.append((f"tiles.flash2_forward:concurrent={label}", tiles.flash2_forward, (q64, k64, k64), kwargs,
                        "concurrent", None))
    sizes = {"B": 1, "Hq": 8, "Hkv": 2, "Nq": 64, "Nk": 64, "d": 16}
    for label, value in {"str": "H100-SXM", "dict": {"l2_bytes": 1}, "3": 3}.items():
        out.append((f"costs.flash2_forward:hw={label}", costs.flash2_forward, tuple(sizes.values()),
                    {"hw": value}, "hw", None))
    for label, value in BAD_CHOICES.items():
        out.append((f"costs.flash2_forward:tiles={label}", costs.flash2_forward, tuple(sizes.values()),
                    {"sram_bytes": 65536, "tiles": value}, "tiles", None))
    for fname, fn in (("costs.flash2_forward", costs.flash2_forward), ("costs.standard_forward",
                                                                        costs.standard_forward)):
        for name in sizes:
            for label, value in BAD_INTS.items():
                bad = {**sizes, name: value}
                out.append((f"{fname}:{name}={label}", fn, tuple(bad.values()), {"sram_bytes": 65536}, name, None))
    return out


def _outcome(fn, args, kwargs, name, oracle):
    """'ok', or what went wrong."""
    import kernels

    try:
        result = fn(*args, **kwargs)
    except (ValueError, TypeError, kernels.InsufficientMemoryError) as err:
        if name in str(err):
            return "ok"
        return f"message does not name {name!r}: {type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001  (the point: any other exception is a finding)
        return f"{type(err).__name__}: {err}"
    if oracle == "attention-oracle":
        from kernels.attn import reference

        ref = reference(*args, **kwargs)
        same_nan = np.array_equal(np.isnan(result), np.isnan(ref))
        finite = np.isfinite(ref)
        close = np.allclose(result[finite], ref[finite], atol=1e-5) and np.array_equal(np.isfinite(result), finite)
        return "ok" if same_nan and close else "differs from the oracle"
    return "returned instead of refusing"


def run(first: int) -> None:
    """Print one JSON line per case from case ``first`` on (the parent restarts after a crash)."""
    import warnings

    warnings.simplefilter("ignore")
    for index, (case_id, fn, args, kwargs, name, oracle) in enumerate(cases()):
        if index < first:
            continue
        print(json.dumps({"index": index, "case": case_id, "outcome": _outcome(fn, args, kwargs, name, oracle)}),
              flush=True)


if __name__ == "__main__":
    run(int(sys.argv[1]))
