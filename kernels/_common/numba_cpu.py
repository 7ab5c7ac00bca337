"""What the Numba CPU kernels of every algorithm share: the CPU features Numba compiles for, an array element's
address for intrinsics that load vectors, bit casts between
floats and integers (for building 2^r in the exponent bits and for rounding to float16), the CPU's own rounding to
float16, and ``exp_row``, the branch-free exp over a row of scores that
the flash kernel and SnapKV's window scores use (its measured effect is in ``kernels/attn/_numba_cpu.py``, v3 and
v5)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, errors, njit, types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload

# Fast-math without 'nnan'/'ninf': reductions may be reassociated (so they vectorize), but NaN and inf keep their
# IEEE meaning, which the NaN-propagation contract of kernels.attention relies on.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

LOG2E = 1.4426950408889634  # log2(e): exp(x) = 2^(x · log2 e)
# ln 2 split in two (Cody & Waite 1980, "Software Manual for the Elementary Functions", ch. 6): the high part
# has few enough mantissa bits that r·LN2_HI is exact, so x − r·ln2 keeps its precision for large |x|.
# Values: Cephes expf (0.693359375, -2.12194440e-4) and fdlibm e_exp.c (ln2HI, ln2LO).
LN2_HI_F32, LN2_LO_F32 = 0.693359375, -2.12194440e-4
LN2_HI_F64, LN2_LO_F64 = 6.93147180369123816490e-01, 1.90821492927058770002e-10
# exp's argument is clamped to the normal range, exp(-87) > 2^-126 and exp(88) < 2^127 (float32), likewise
# exp(±708) for float64: below, a term adds nothing next to the exp(0) = 1 of the reference maximum.
EXP_MIN_F32, EXP_MAX_F32 = -87.0, 88.0
EXP_MIN_F64, EXP_MAX_F64 = -708.0, 708.0


def target_features() -> set[str]:
    """The x86 features Numba compiles for: ``numba.config.CPU_FEATURES`` when set (NUMBA_CPU_FEATURES; ''
    with NUMBA_CPU_NAME=generic), else the host's as LLVM reports them. A feature that only a NUMBA_CPU_NAME
    implies is not seen, which errs towards the portable code."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def is_c_array(a) -> bool:
    """Whether a Numba type is a C-contiguous array (the intrinsics below and in ``kernels.int8`` index it flat)."""
    return isinstance(a, types.Array) and a.layout == "C"


def byte_address(context, builder, array_type, array, index_type, index):
    """In an intrinsic's code generation: &array.flat[index] of a C-contiguous array, as an i8 pointer (no bounds
    check: the callers' loops bound the index)."""
    data = context.make_array(array_type)(context, builder, array).data
    index = context.cast(builder, index, index_type, types.intp)
    return builder.bitcast(builder.gep(data, [index]), ir.IntType(8).as_pointer())


@intrinsic
def round_half(typingctx, value):
    """A float32 rounded to binary16 and back by the CPU: LLVM's ``fptrunc`` to ``half`` and ``fpext`` (LLVM
    Language Reference, "'fptrunc .. to' Instruction"), on x86 with F16C ``VCVTPS2PH`` / ``VCVTPH2PS`` (Intel SDM
    vol. 2C: the rounding MXCSR selects, round to nearest even by default; overflow gives ±inf, NaN stays NaN).
    Only for a target with F16C: elsewhere LLVM emits a call of a conversion routine that Numba's JIT does not
    resolve (the process dies: tried with NUMBA_CPU_FEATURES of plain SSE2), so there it does not compile."""
    if value != types.float32:
        return None
    if "f16c" not in target_features():
        raise errors.TypingError("round_half needs a target with F16C; use the software rounding")

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(value), codegen


@intrinsic
def as_float(typingctx, bits):
    """Reinterpret the bits of an int32 as a float32, or of an int64 as a float64 (no conversion)."""
    targets = {types.int32: (types.float32, ir.FloatType()), types.int64: (types.float64, ir.DoubleType())}
    if bits not in targets:
        return None
    result, llvm_type = targets[bits]

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)

    return result(bits), codegen


@intrinsic
def as_int(typingctx, value):
    """Reinterpret the bits of a float32 as an int32, or of a float64 as an int64 (no conversion)."""
    targets = {types.float32: (types.int32, ir.IntType(32)), types.float64: (types.int64, ir.IntType(64))}
    if value not in targets:
        return None
    result, llvm_type = targets[value]

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)

    return result(value), codegen


@njit(inline="always")
def clamp(x, lo, hi):
    """x limited to [lo, hi]; unlike min/max, a NaN x stays NaN (each comparison is false for it)."""
    x = lo if x < lo else x
    return hi if x > hi else x


def exp_row(s, p, n, m, c):
    """p[j] ← exp((s[j] − m)·c) for j < n, and return their sum (compiled by the overload below).

    m is a reference score in the units of s (a running maximum), c > 0 the softmax scale. The difference is taken
    before the scaling: at the maximum it is exactly 0, whatever the magnitude of s·c (computed as s·c − m·c, a
    fused multiply-add keeps the rounding error of m·c, ~1e3 at |s·c| ~ 1e10 in float32, far beyond exp's range).

    exp(x) = 2^r · exp(f), r = round(x·log2 e), f = x − r·ln 2 in [−ln2/2, ln2/2]: 2^r is built straight in the
    exponent bits of a float (IEEE 754), exp(f) is its Taylor polynomial, degree 6 for float32 (truncation error
    ≤ 0.347⁷/7! = 1.2e-7 relative) and degree 12 for float64 (≤ 0.347¹³/13! = 1.8e-16). x is clamped to the
    normal exponent range, so no bit pattern wraps; a clamped large x shows as a huge sum, which the caller
    treats as a new maximum. A NaN passes the clamp and makes the sum NaN. One pass, no branch: it vectorizes
    where the caller compiles with FASTMATH (the sum needs its reassociation; the overload compiles with its
    caller's flags, Numba's ``overload`` taking no ``fastmath`` of its own), and runs scalar elsewhere.
    """
    raise NotImplementedError("compiled through numba.extending.overload; call it from jitted code")


@intrinsic
def fenced(typingctx, x):
    """x, kept whole under fast-math reassociation where the target has no FMA: LLVM's ``llvm.arithmetic.fence``
    (LLVM Language Reference, "'llvm.arithmetic.fence' Intrinsic"; it emits no instruction). The exp below reduces
    its argument as (x − r·ln2_hi) − r·ln2_lo. With 'reassoc' and no FMA to fuse each product into its subtraction
    first, LLVM regrouped that into x − r·(ln2_hi + ln2_lo), one rounded ln 2, and exp's error grew from under 6e-7
    to 4.2e-6 relative (``NUMBA_CPU_NAME=generic``, arguments down to −80). The fence also stops the loop from
    vectorizing (``exp_row`` over 4096 float32: 2.2 -> 12.1 us on a Zen 3), so where there is FMA, whose fused
    operations keep the split (the same test holds there), x passes unchanged."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        if "fma" in target_features():
            return args[0]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(args[0].type, [args[0].type]),
                                            f"llvm.arithmetic.fence.{'f32' if x == types.float32 else 'f64'}")
        return builder.call(fn, args)

    return x(x), codegen


@njit(inline="always")
def exp_f32(x):
    """``exp_row``'s exp of one float32 (clamped to the normal range, then 2^r · a degree-6 polynomial): scalar
    arguments only, so a loop that calls it counts no references, and without a sum a plain loop of it
    vectorizes whatever the caller's flags (``kernels.decode``'s attention)."""
    x = clamp(x, np.float32(EXP_MIN_F32), np.float32(EXP_MAX_F32))
    r = np.floor(x * np.float32(LOG2E) + np.float32(0.5))  # round(x · log2 e), kept in float32
    f = fenced(x - r * np.float32(LN2_HI_F32)) - r * np.float32(LN2_LO_F32)  # x − r·ln2 in [-ln2/2, ln2/2]
    poly = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(1 / 2) + f * (np.float32(1 / 6) + f * (
        np.float32(1 / 24) + f * (np.float32(1 / 120) + f * np.float32(1 / 720))))))
    two_r = as_float(np.int32((np.int32(r) + np.int32(127)) << np.int32(23)))  # 2^r: biased exponent (binary32)
    return poly * two_r


def _exp_row_f32(s, p, n, m, c):
    c32, m32 = np.float32(c), np.float32(m)  # keep the loop in float32 (a float64 m would widen every lane)
    total = np.float32(0.0)
    for j in range(n):
        e = exp_f32((s[j] - m32) * c32)
        p[j] = e
        total += e
    return total


def _exp_row_f64(s, p, n, m, c):
    total = 0.0
    for j in range(n):
        x = clamp((s[j] - m) * c, EXP_MIN_F64, EXP_MAX_F64)
        r = np.floor(x * LOG2E + 0.5)  # round(x · log2 e)
        f = fenced(x - r * LN2_HI_F64) - r * LN2_LO_F64  # x − r·ln2 in [-ln2/2, ln2/2]
        poly = 1.0 / 479001600.0  # 1/12!, then Horner down to 1/0!
        poly = 1.0 / 39916800.0 + f * poly
        poly = 1.0 / 3628800.0 + f * poly
        poly = 1.0 / 362880.0 + f * poly
        poly = 1.0 / 40320.0 + f * poly
        poly = 1.0 / 5040.0 + f * poly
        poly = 1.0 / 720.0 + f * poly
        poly = 1.0 / 120.0 + f * poly
        poly = 1.0 / 24.0 + f * poly
        poly = 1.0 / 6.0 + f * poly
        poly = 0.5 + f * poly
        poly = 1.0 + f * poly
        poly = 1.0 + f * poly
        e = poly * as_float(np.int64((np.int64(r) + np.int64(1023)) << np.int64(52)))  # 2^r (binary64)
        p[j] = e
        total += e
    return total


@overload(exp_row)  # (compiled with the caller's flags: see the docstring)
def _exp_row_overload(s, p, n, m, c):
    if s.dtype == types.float32:
        return _exp_row_f32
    return _exp_row_f64


def row_max(s, n, m):
    """max(m, s[0:n]) for a float32 or float64 row s, the NaNs of s left out (compiled by the overload below).

    Compared as integers, so that the loop vectorizes: LLVM vectorizes a float max reduction only without NaNs
    ('nnan', which FASTMATH leaves out), an integer one always. A float's bits x, flipped to x ^ 0x7fff...ff where
    the sign is set, order as signed integers as the floats do (IEEE 754 orders the magnitudes as their bit
    patterns); a NaN counts as the smallest key. Equal to the scalar loop's result, up to the sign of a zero
    maximum (-0.0 and +0.0 compare equal). Measured on a 2-vCPU Xeon (AVX-512), a row of 512 float32: 486 ns as a
    float compare-and-select loop, 37 ns this way (float64: 453 and 97 ns), the exp pass 171 ns.
    """
    raise NotImplementedError("compiled through numba.extending.overload; call it from jitted code")


def _row_max_f32(s, n, m):
    # (every step cast back to int32: Numba widens int32 arithmetic to int64)
    low = np.int32(0x7FFFFFFF)
    bits = as_int(np.float32(m))
    best = np.int32(bits ^ ((bits >> np.int32(31)) & low))
    for j in range(n):
        x = s[j]
        bits = as_int(x)
        key = np.int32(bits ^ np.int32((bits >> np.int32(31)) & low))
        key = key if x == x else np.int32(-0x80000000)
        best = max(best, key)
    return as_float(np.int32(best ^ np.int32((best >> np.int32(31)) & low)))


def _row_max_f64(s, n, m):
    low = np.int64(0x7FFFFFFFFFFFFFFF)
    best = as_int(np.float64(m))
    best ^= (best >> np.int64(63)) & low
    for j in range(n):
        x = s[j]
        bits = as_int(x)
        key = bits ^ ((bits >> np.int64(63)) & low)
        key = key if x == x else np.int64(-0x8000000000000000)
        best = max(best, key)
    return as_float(best ^ ((best >> np.int64(63)) & low))


@overload(row_max)  # (integer keys: vectorizes with any flags)
def _row_max_overload(s, n, m):
    if s.dtype == types.float32:
        return _row_max_f32
    return _row_max_f64
