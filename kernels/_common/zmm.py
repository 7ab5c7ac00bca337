"""Sixteen float32 lanes as one Numba value: a ``<16 x float>`` LLVM vector, which LLVM keeps in one AVX-512 zmm
register, with the few operations a streaming dot product and a softmax need (load and store, byte-exact masked ones
for a tail, a scalar in every lane, add, fused multiply-add, maximum, the sum and the maximum of the lanes).

Why: LLVM vectorizes for Intel's AVX-512 cores with 256-bit vectors (its X86 tuning ``TuningPrefer256Bit``, set
for Skylake-SP and later in ``llvm/lib/Target/X86/X86.td``), so Numba's plain float32 dot-product loop compiles to
ymm FMAs even where zmm ones exist (seen in its assembly on the Xeon below): twice the instructions per cache line
of weights. Where the weights stream from DRAM that costs bandwidth (``kernels/dense.py``, v3). ``AVAILABLE`` says
whether the target Numba compiles for has AVX-512F; elsewhere those callers keep their plain loops (a
``<16 x float>`` there would be split into narrower registers, and without FMA ``llvm.fma`` becomes a library call).

``VECTORS`` says whether the vectors compile to vector code at all: AVX-512F, or AVX2 with FMA, where each
operation becomes two ymm instructions. That is what a caller needs whose plain loop is not bandwidth-bound but a
chain of dependent scalar adds, kept in order so that two paths agree bit for bit: the decode attention's scores
(``kernels.decode._fused``, v7), 64 dependent multiply-adds per score in the loop.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .numba_cpu import target_features

LANES = 16  # float32 lanes of a zmm register (64 bytes)
AVAILABLE = "avx512f" in target_features()
VECTORS = AVAILABLE or {"avx2", "fma"} <= target_features()  # the vectors in two ymm registers each (see above)


class Float32x16(types.Type):
    """A <16 x float> LLVM vector: 16 float32 partial sums, or 16 consecutive float32 values of an array."""

    def __init__(self):
        super().__init__(name="float32x16")


float32x16 = Float32x16()
_VEC = ir.VectorType(ir.FloatType(), LANES)
_MASK = ir.VectorType(ir.IntType(1), LANES)
_I32 = ir.IntType(32)


@register_model(Float32x16)
class _Float32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _is_float32_c_array(a):
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32


def _pointer(context, builder, array_type, array, index_type, index):
    """&array.flat[index] of a C-contiguous float32 array, as a <16 x float> pointer (no bounds check: the callers'
    loops bound the index)."""
    data = context.make_array(array_type)(context, builder, array).data
    index = context.cast(builder, index, index_type, types.intp)
    return builder.bitcast(builder.gep(data, [index]), _VEC.as_pointer())


def _lane_mask(context, builder, count, count_type):
    """<16 x i1>: lane i is set where i < count."""
    n = builder.trunc(context.cast(builder, count, count_type, types.int64), _I32)
    splat = builder.shuffle_vector(builder.insert_element(ir.Constant(ir.VectorType(_I32, LANES), None), n, _I32(0)),
                                   ir.Constant(ir.VectorType(_I32, LANES), None),
                                   ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
    return builder.icmp_unsigned("<", ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES))), splat)


@intrinsic
def fzero(typingctx):
    """16 float32 zeros."""
    return float32x16(), lambda context, builder, signature, args: ir.Constant(_VEC, None)


@intrinsic
def fload(typingctx, array, index):
    """array.flat[index : index + 16] of a C-contiguous float32 array (an unaligned load)."""
    if not (_is_float32_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = _pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load(p, align=4)

    return float32x16(array, index), codegen


@intrinsic
def fload_first(typingctx, array, index, count):
    """The first ``count`` (< 16) floats of array.flat[index:], zeros in the other lanes; nothing past them is
    read (``llvm.masked.load``; AVX-512F's ``vmovups {z}`` with a lane mask), so a row's tail at the end of an
    array is safe to load."""
    if not (_is_float32_c_array(array) and isinstance(index, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = _pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        mask = _lane_mask(context, builder, args[2], signature.args[2])
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VEC, [p.type, _I32, _MASK, _VEC]), "llvm.masked.load.v16f32.p0")
        return builder.call(masked_load, [p, _I32(4), mask, ir.Constant(_VEC, None)])

    return float32x16(array, index, count), codegen


@intrinsic
def ffma(typingctx, a, b, acc):
    """a · b + acc in each lane, rounded once (``llvm.fma``: ``vfmadd231ps``)."""
    if not (a == float32x16 and b == float32x16 and acc == float32x16):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32")
        return builder.call(fn, args)

    return float32x16(a, b, acc), codegen


@intrinsic
def fsum(typingctx, v):
    """The sum of the 16 lanes (``llvm.vector.reduce.fadd``: in lane order, or as a tree where the caller compiles
    with fast-math's ``reassoc``)."""
    if v != float32x16:
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), _VEC]),
                                            "llvm.vector.reduce.fadd.v16f32")
        return builder.call(fn, [ir.Constant(ir.FloatType(), 0.0), args[0]])

    return types.float32(v), codegen


@intrinsic
def fsum_halves(typingctx, v):
    """The sum of the 16 lanes in a fixed tree: lanes i and i + 8 added, then i and i + 4 of those, then i and
    i + 2, then the last two (explicit shuffles and adds, so no optimization reorders it). ``fsum``'s lane order
    is a chain of 15 dependent adds; this one is 4 deep."""
    if v != float32x16:
        return None

    def codegen(context, builder, signature, args):
        x, width = args[0], LANES
        while width > 1:
            half = width // 2
            low = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            high = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
            x, width = builder.fadd(low, high), half
        return builder.extract_element(x, _I32(0))

    return types.float32(v), codegen


@intrinsic
def fsplat(typingctx, x):
    """The float32 x in all 16 lanes."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        one = builder.insert_element(ir.Constant(_VEC, None), value, _I32(0))
        return builder.shuffle_vector(one, ir.Constant(_VEC, None), ir.Constant(ir.VectorType(_I32, LANES),
                                                                                 [0] * LANES))

    return float32x16(x), codegen


@intrinsic
def fadd(typingctx, a, b):
    """a + b in each lane."""
    if not (a == float32x16 and b == float32x16):
        return None
    return float32x16(a, b), lambda context, builder, signature, args: builder.fadd(args[0], args[1])


@intrinsic
def fmax(typingctx, a, b):
    """The larger of a and b in each lane (``llvm.maxnum``: of two numbers the larger; exact, so the maximum of many
    values does not depend on the order they are taken in)."""
    if not (a == float32x16 and b == float32x16):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 2), "llvm.maxnum.v16f32")
        return builder.call(fn, args)

    return float32x16(a, b), codegen


@intrinsic
def fmax_lanes(typingctx, v):
    """The largest of the 16 lanes (``llvm.vector.reduce.fmax``)."""
    if v != float32x16:
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [_VEC]),
                                            "llvm.vector.reduce.fmax.v16f32")
        return builder.call(fn, args)

    return types.float32(v), codegen


@intrinsic
def fstore(typingctx, array, index, v):
    """array.flat[index : index + 16] = v for a C-contiguous float32 array (an unaligned store)."""
    if not (_is_float32_c_array(array) and isinstance(index, types.Integer) and v == float32x16):
        return None

    def codegen(context, builder, signature, args):
        p = _pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()

    return types.none(array, index, v), codegen


@intrinsic
def fstore_first(typingctx, array, index, count, v):
    """array.flat[index : index + count] = the first ``count`` (< 16) lanes of v; nothing past them is written
    (``llvm.masked.store``)."""
    if not (_is_float32_c_array(array) and isinstance(index, types.Integer) and isinstance(count, types.Integer)
            and v == float32x16):
        return None

    def codegen(context, builder, signature, args):
        p = _pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        mask = _lane_mask(context, builder, args[2], signature.args[2])
        masked_store = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_VEC, p.type, _I32, _MASK]), "llvm.masked.store.v16f32.p0")
        builder.call(masked_store, [args[3], p, _I32(4), mask])
        return context.get_dummy_value()

    return types.none(array, index, count, v), codegen
