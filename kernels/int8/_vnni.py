"""The int8 GEMM and decode GEMV of LLM.int8() on integer dot-product instructions: AVX512-VNNI's ``vpdpbusd``
(Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2C, "VPDPBUSD"), emitted from Numba through
LLVM intrinsics (``llvm.x86.avx512.vpdpbusd.512``).

``vpdpbusd acc, a, b`` adds to each of 16 int32 lanes the sum of four products of an unsigned byte of ``a`` and a
signed byte of ``b``: 64 multiply-adds per instruction, where LLVM's vectorization of the plain loop in
``_numba_cpu`` (int8 widened to int32) does 16. The activations are signed, so they are offset by +128 into
[1, 255] (an exact xor of the sign bit) and the offset is taken back per output:

    Σ_k x[m, k] · w[n, k] = Σ_k (x[m, k] + 128) · w[n, k] − 128 · Σ_k w[n, k],

with the weights' row sums Σ_k w[n, k] computed once per weight (``Int8Weight.w_row_sums``). The instruction
wraps (no saturation), so every sum here is exact modulo 2^32 and the result, whose true value fits in an int32
(K <= MAX_EXACT_K), is exact: bit-identical to the int32 loop and the int64 oracle.

Chosen at run time: the kernels compile only when the target Numba compiles for has AVX512-VNNI and AVX512-BW
(``AVAILABLE``: ``NUMBA_CPU_FEATURES``/``NUMBA_CPU_NAME=generic`` override the host's features, as they do for all
of Numba's code); anywhere else ``_numba_cpu``'s loop runs (LLVM cannot select the intrinsic without the feature).

Versions (2-vCPU Intel Xeon, Sapphire Rapids class, KVM, shared with other jobs while measured):
  v1 (this file): the GEMV streams the (N, K) weight rows once, a 64-byte dot product per step (a masked load
      for the K tail), one horizontal sum per output. The GEMM packs Wᵀ into panels of NR = 64 outputs ×
      4 k (the operand layout of ``vpdpbusd``, zero-padded in K and N) once per call, then a register-blocked
      MR × NR = 6 × 64 micro-tile (24 zmm accumulators) broadcasts 4 activation bytes per row against the
      panel's 4 vectors per step of k; the dequantization in its epilogue. The int32 product 512 x 4096 x 4096
      alone: 12.1 ms (1.4 TOP/s, 3.7x NumPy's sgemm of the same size, 45 ms, at a quiet moment; the loop:
      207 ms), the packing 1.3 ms more. ``benchmarks/test_bench_int8.py`` (one run, other jobs running):
      Int8Linear GEMM 19.9 ms median (862 GOP/s; NumPy sgemm 152.8 ms; each call after a settle, interleaved:
      2.84x), GEMV 8192² 1.22 ms (54.8 GB/s of int8 weights, which this VM's 480 MiB L3 holds; NumPy float32
      24.0 ms; settled and interleaved 2.25x: a cold call pays about 0.7 ms to wake the threads). With other
      jobs on the second core every two-thread call waits out their time slice (medians of about 8 ms).
  v2: the GEMV reads four weight rows at once (``_dot_rows4``: four streams, four independent chains of
      ``vpdpbusd``). 256 MiB of weights, two threads, side by side in one process: one row at a time 27.0 GB/s,
      four 32.1, a plain read (``simulator.calibrate``) 33.5. ``benchmarks/test_bench_int8.py``'s GEMV 8192²
      streamed as in decode (15 copies of the weights called in turn), alternating runs of v1 and v2: 2.66-2.67
      -> 2.39-2.41 ms, 3.56-3.57x -> 3.85-3.93x NumPy's float32 GEMV streamed alike (9.3-9.5 ms).
  v3: the GEMM packs each panel when a worker reaches it, into that worker's own slot (K·NR bytes, in L2), instead
      of all panels into a fresh (P, Kq, NR) array before the product (for 4096² a 16 MiB array whose pages every
      call faulted in, written and then read back). ``Int8Linear`` 512 x 4096 x 4096 in turn with NumPy's sgemm
      (15 pairs, OpenBLAS's workers sleeping at once: ``OPENBLAS_THREAD_TIMEOUT=4``), alternating fresh processes
      with v2 (3 pairs): 20.6-22.1 -> 19.4-20.3 ms median, p90 22.0-22.6 -> 19.9-20.8 ms; 2.66-2.90x -> 2.82-3.04x
      the sgemm.
  v4 (2-vCPU AMD EPYC, Zen 4, KVM): the GEMV reads one row at a time again, now with four chains of ``vpdpbusd``
      along it (``_dot_row``): on this machine 1.9-2.6x faster than v2 at 2048², 0.98-1.15x at 8192² (figures
      in ``split_gemv``). Not measured on the Xeon, where v2's four rows beat one row with a single chain.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .._common.numba_cpu import byte_address, is_c_array, target_features
from ._numba_cpu import GEMV_BN, QMAX, _dequantized, _gemv_prologue, _plus_outliers, _quantize_row

REQUIRED_FEATURES = ("avx512f", "avx512bw", "avx512vnni")  # zmm registers, byte-masked loads, vpdpbusd
VECTOR_BYTES = 64  # one zmm register
LANES = 16  # int32 lanes of a zmm register
OFFSET = 128  # x + 128 maps int8 [-128, 127] onto uint8 [0, 255]
MR = 6  # rows of X per micro-tile
NR = 64  # outputs per micro-tile and per packed panel: 4 zmm registers; MR·NR/16 = 24 of the 32 hold sums
BM = MR * 16  # rows of X per GEMM task: BM·K bytes of X stay in L2 while a panel's micro-tiles pass


AVAILABLE = set(REQUIRED_FEATURES) <= target_features()


# -- a zmm register as a Numba value -----------------------------------------------------------------------------
class Int32x16(types.Type):
    """A <16 x i32> LLVM vector: 16 int32 sums, or 64 bytes to multiply."""

    def __init__(self):
        super().__init__(name="int32x16")


int32x16 = Int32x16()
_VEC = ir.VectorType(ir.IntType(32), LANES)
_BYTES = ir.VectorType(ir.IntType(8), VECTOR_BYTES)
_I32 = ir.IntType(32)


@register_model(Int32x16)
class _Int32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _splat(builder, value, vector_type):
    """``value`` in every lane of ``vector_type`` (an insert into lane 0, then a shuffle of lane 0 everywhere)."""
    undefined = ir.Constant(vector_type, None)
    return builder.shuffle_vector(builder.insert_element(undefined, value, _I32(0)), undefined,
                                  ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


@intrinsic
def vzero(typingctx):
    """16 int32 zeros."""
    return int32x16(), lambda context, builder, signature, args: ir.Constant(_VEC, None)


@intrinsic
def vload(typingctx, array, index):
    """The 64 bytes from &array.flat[index] on (unaligned)."""
    if not (is_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = byte_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=1)

    return int32x16(array, index), codegen


@intrinsic
def vload_first(typingctx, array, index, count):
    """The first ``count`` (< 64) bytes from &array.flat[index] on, zeros after them; nothing past them is read
    (a byte-masked load, AVX512-BW's ``vmovdqu8 {z}``)."""
    if not (is_c_array(array) and isinstance(index, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = byte_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        n = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), ir.IntType(8))
        lanes = ir.Constant(_BYTES, list(range(VECTOR_BYTES)))
        mask = builder.icmp_unsigned("<", lanes, _splat(builder, n, _BYTES))  # lane i loads when i < count
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_BYTES, [p.type, _I32, mask.type, _BYTES]), "llvm.masked.load.v64i8.p0")
        loaded = builder.call(masked_load, [p, _I32(1), mask, ir.Constant(_BYTES, None)])
        return builder.bitcast(loaded, _VEC)

    return int32x16(array, index, count), codegen


@intrinsic
def vdpbusd(typingctx, acc, a, b):
    """acc[i] + Σ_{j<4} uint8(a[4i + j]) · int8(b[4i + j]) for each of the 16 lanes, wrapping (``vpdpbusd``)."""
    if not (acc == int32x16 and a == int32x16 and b == int32x16):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, args)

    return int32x16(acc, a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    """a + b lane by lane (16 int32, wrapping)."""
    if not (a == int32x16 and b == int32x16):
        return None
    return int32x16(a, b), lambda context, builder, signature, args: builder.add(args[0], args[1])


@intrinsic
def vsum(typingctx, v):
    """Σ of the 16 int32 lanes, wrapping."""
    if v != int32x16:
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_VEC]),
                                            "llvm.vector.reduce.add.v16i32")
        return builder.call(fn, args)

    return types.int32(v), codegen


@intrinsic
def load_int32(typingctx, array, index):
    """The 4 bytes from &array.flat[index] on, as one int32 (unaligned): a group of 4 k of one weight row."""
    if not (is_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = byte_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)

    return types.int32(array, index), codegen


@intrinsic
def micro_tile(typingctx, x_u8, m0, panel, tile):
    """tile[i, :] = Σ_q broadcast(x_u8[min(m0 + i, M − 1), 4q : 4q + 4]) ⊙ panel[q, :] for i < MR (wrapping int32).

    x_u8 (M, 4·Kq) uint8, panel (Kq, NR) int32 (4 k of one output per int32), tile (MR, NR) int32. Unrolled at
    code generation: MR·NR/16 accumulators, each step of q loads the panel row's NR/16 vectors once and
    broadcasts one int32 per row of X against them. Rows past M repeat row M − 1 (their sums are not used)."""
    if not (is_c_array(x_u8) and is_c_array(panel) and is_c_array(tile) and isinstance(m0, types.Integer)):
        return None
    n_vectors = NR // LANES

    def codegen(context, builder, signature, args):
        x_t, m0_t, panel_t, tile_t = signature.args
        x_arr = context.make_array(x_t)(context, builder, args[0])
        M, row_bytes = cgutils.unpack_tuple(builder, x_arr.shape, 2)
        Kq = cgutils.unpack_tuple(builder, context.make_array(panel_t)(context, builder, args[2]).shape, 2)[0]
        x_data = builder.bitcast(x_arr.data, ir.IntType(8).as_pointer())
        m0_v = context.cast(builder, args[1], m0_t, types.intp)
        last = builder.sub(M, ir.Constant(M.type, 1))
        rows = []
        for i in range(MR):  # &x_u8[min(m0 + i, M - 1), 0]
            m = builder.add(m0_v, ir.Constant(M.type, i))
            m = builder.select(builder.icmp_signed("<", m, M), m, last)
            rows.append(builder.gep(x_data, [builder.mul(m, row_bytes)]))
        panel_data = builder.bitcast(context.make_array(panel_t)(context, builder, args[2]).data, _I32.as_pointer())
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in range(n_vectors)]
                for _ in range(MR)]
        with cgutils.for_range(builder, Kq) as loop:
            q = loop.index
            row = builder.gep(panel_data, [builder.mul(q, ir.Constant(q.type, NR))])
            b = [builder.load(builder.bitcast(builder.gep(row, [ir.Constant(q.type, LANES * j)]), _VEC.as_pointer()),
                              align=4) for j in range(n_vectors)]
            for i in range(MR):
                a32 = builder.load(builder.bitcast(builder.gep(rows[i], [builder.shl(q, ir.Constant(q.type, 2))]),
                                                   _I32.as_pointer()), align=1)
                a = _splat(builder, a32, _VEC)
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
                for j in range(n_vectors):
                    builder.store(builder.call(fn, [builder.load(accs[i][j]), a, b[j]]), accs[i][j])
        tile_data = builder.bitcast(context.make_array(tile_t)(context, builder, args[3]).data, _I32.as_pointer())
        for i in range(MR):
            for j in range(n_vectors):
                dst = builder.gep(tile_data, [ir.Constant(ir.IntType(64), i * NR + LANES * j)])
                builder.store(builder.load(accs[i][j]), builder.bitcast(dst, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(x_u8, m0, panel, tile), codegen


_F32 = ir.FloatType()
_FLOATS = ir.VectorType(_F32, LANES)
_MASK = ir.VectorType(ir.IntType(1), LANES)


def _masked(builder, name, fn_type, args):
    return builder.call(cgutils.get_or_insert_function(builder.module, fn_type, name), args)


def _data(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array).data


def _lanes_at(context, builder, array_type, array, n0, vector_type):
    """&array[n0] (a C-contiguous array, n0 an i64) as a pointer to ``vector_type``: its 16 lanes from n0 on."""
    return builder.bitcast(builder.gep(_data(context, builder, array_type, array), [n0]), vector_type.as_pointer())


def _first_lanes(builder, count):
    """The mask of lanes 0 .. count − 1 (count an i64) of 16: the outputs n0 .. n0 + count − 1 of a masked load or
    store at n0."""
    lanes = ir.Constant(ir.VectorType(ir.IntType(64), LANES), list(range(LANES)))
    return builder.icmp_unsigned("<", lanes, _splat(builder, count, lanes.type))


def _outlier_products(context, builder, signature, args, column):
    """The code of ``_numba_cpu._plus_outliers`` on 16 lanes, in place, for an intrinsic whose first arguments are
    (y, n0, count, absmax_w, x_o, cols, J): y[n0 + l] += Σ_j x_o[0, j] · float16(w · absmax_w[n0 + l] / 127) for
    l < count, w lane l of ``column(c)``, the 16 weights (an integer vector) of outlier column c = cols[j]."""
    y_t, n0_t, count_t, a_t, xo_t, cols_t, J_t = signature.args[:7]
    n0_v = context.cast(builder, args[1], n0_t, types.int64)
    mask = _first_lanes(builder, context.cast(builder, args[2], count_t, types.int64))  # lane l is output n0 + l
    masked_load = ir.FunctionType(_FLOATS, [_FLOATS.as_pointer(), _I32, _MASK, _FLOATS])
    y_p = _lanes_at(context, builder, y_t, args[0], n0_v, _FLOATS)
    a_p = _lanes_at(context, builder, a_t, args[3], n0_v, _FLOATS)
    ones = ir.Constant(_FLOATS, [1.0] * LANES)
    acc = cgutils.alloca_once_value(builder, _masked(builder, "llvm.masked.load.v16f32.p0", masked_load,
                                                     [y_p, _I32(4), mask, ones]))
    absmax = _masked(builder, "llvm.masked.load.v16f32.p0", masked_load, [a_p, _I32(4), mask, ones])
    step = builder.fdiv(absmax, ir.Constant(_FLOATS, [float(QMAX)] * LANES))  # absmax_w[n] / 127, per lane
    cols_p, xo_p = _data(context, builder, cols_t, args[5]), _data(context, builder, xo_t, args[4])
    J_v = context.cast(builder, args[6], J_t, types.int64)
    with cgutils.for_range(builder, J_v) as loop:
        j = loop.index
        w = column(builder.load(builder.gep(cols_p, [j])))
        xj = builder.load(builder.gep(xo_p, [j]))
        scaled = builder.fmul(builder.sitofp(w, _FLOATS), step)  # float32(w[n, c]) · step
        rounded = builder.fpext(builder.fptrunc(scaled, ir.VectorType(ir.HalfType(), LANES)), _FLOATS)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(_splat(builder, xj, _FLOATS), rounded)), acc)
    _masked(builder, "llvm.masked.store.v16f32.p0",
            ir.FunctionType(ir.VoidType(), [_FLOATS, _FLOATS.as_pointer(), _I32, _MASK]),
            [builder.load(acc), y_p, _I32(4), mask])


@intrinsic
def plus_outliers16(typingctx, y, n0, count, absmax_w, x_o, cols, J, w_flat, first, lane_stride, group_stride):
    """``_numba_cpu._plus_outliers`` for the ``count`` (1 to 16) outputs n0 .. n0 + count − 1 at once, in place:
    y[n] += Σ_j x_o[0, j] · float16(w[n, cols[j]] · absmax_w[n] / 127), over j < J in order, one output per lane.

    Each lane does what the scalar code does, in the same order (the float32 product, the rounding to binary16 and
    back, the product with the feature's value, the sum), so the outputs are bit for bit the scalar ones; 16 at
    once, where LLVM kept the scalar loop scalar. A step of j gathers the 16 weights of column cols[j] (16 loads of
    a byte). Lanes past ``count`` read output n0 + count − 1's weight and write nothing. y, absmax_w (N,) float32,
    x_o (1, K) float32, cols (K,) int64, w_flat the int8 weight's flat view, in which w[n0 + l, c] is the byte at
    first + l·lane_stride + (c // 4)·group_stride + c % 4: rows of K bytes (n0·K, K, 4); a panel of 16 rows (the
    panel's first byte, 4, 64) has its own, which reads a column's 16 weights in one load
    (``panels.plus_panel_outliers16``)."""
    arrays = (y, absmax_w, x_o, cols, w_flat)
    if not (all(is_c_array(a) for a in arrays) and w_flat.dtype == types.int8 and cols.dtype == types.int64
            and all(a.dtype == types.float32 for a in (y, absmax_w, x_o))
            and all(isinstance(i, types.Integer) for i in (n0, count, J, first, lane_stride, group_stride))):
        return None  # no typing: Numba raises its TypingError at compile time, where the codegen would misread

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        count_v = context.cast(builder, args[2], signature.args[2], types.int64)
        first_v, lane_v, group_v = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (8, 9, 10))
        w_data = builder.bitcast(_data(context, builder, signature.args[7], args[7]), ir.IntType(8).as_pointer())
        last = builder.sub(count_v, ir.Constant(i64, 1))
        rows = []  # the address of w[n0 + min(l, count − 1), 0]
        for lane in range(LANES):
            r = builder.select(builder.icmp_signed("<", ir.Constant(i64, lane), count_v), ir.Constant(i64, lane), last)
            rows.append(builder.gep(w_data, [builder.add(first_v, builder.mul(r, lane_v))]))

        def column(c):  # the 16 bytes of column c, one load each
            c = builder.add(builder.mul(builder.ashr(c, ir.Constant(i64, 2)), group_v),
                            builder.and_(c, ir.Constant(i64, 3)))  # (c // 4)·group_stride + c % 4
            w = ir.Constant(ir.VectorType(ir.IntType(8), LANES), None)
            for lane in range(LANES):
                w = builder.insert_element(w, builder.load(builder.gep(rows[lane], [c])), _I32(lane))
            return w

        _outlier_products(context, builder, signature, args, column)
        return context.get_dummy_value()

    return types.none(y, n0, count, absmax_w, x_o, cols, J, w_flat, first, lane_stride, group_stride), codegen


@intrinsic
def dequantized16(typingctx, y, n0, count, sums, w_row_sums, absmax_w, scale):
    """``_dequantized(_corrected(...))`` for the ``count`` (1 to 16) outputs n0 .. n0 + count − 1 at once: y[n] =
    float32(s − 128 · w_row_sums[n]) · (scale · absmax_w[n]), s the lane's wrapped int32 sum of (x + 128)·w in
    ``sums`` and scale the input's absmax · (1/127²), as the scalar code computes it. The same operations in the same
    order, one output per lane (int32 arithmetic wraps as ``_corrected``'s truncation of the exact int64 does), so
    the outputs are bit for bit the scalar ones. Nothing past ``count`` is read or written (masked loads and store).
    y, absmax_w (N,) float32, w_row_sums (N,) int32.

    Why: written out per output, a panel's epilogue was 16 outputs' scalar loads, conversions and products beside
    its 144 ``vpdpbusd`` at K = 576, and a thread that streams its weights from DRAM reads only as far ahead as its
    instructions reach (``panels``, v2)."""
    if not (is_c_array(y) and y.dtype == types.float32 and is_c_array(absmax_w) and absmax_w.dtype == types.float32
            and is_c_array(w_row_sums) and w_row_sums.dtype == types.int32 and sums == int32x16
            and isinstance(n0, types.Integer) and isinstance(count, types.Integer) and scale == types.float32):
        return None

    def codegen(context, builder, signature, args):
        y_t, n0_t, count_t, _, r_t, a_t, _ = signature.args

        def at(array_type, value, vector_type):  # &array[n0] as a pointer to a vector
            return _lanes_at(context, builder, array_type, value, n0_v, vector_type)

        n0_v = context.cast(builder, args[1], n0_t, types.int64)
        mask = _first_lanes(builder, context.cast(builder, args[2], count_t, types.int64))  # lane l is output n0 + l
        row_sums = _masked(builder, "llvm.masked.load.v16i32.p0",
                           ir.FunctionType(_VEC, [_VEC.as_pointer(), _I32, _MASK, _VEC]),
                           [at(r_t, args[4], _VEC), _I32(4), mask, ir.Constant(_VEC, None)])
        offset = ir.Constant(_VEC, [OFFSET] * LANES)
        corrected = builder.sub(args[3], builder.mul(row_sums, offset))  # s − 128·Σ w, wrapped as _corrected's
        absmax = _masked(builder, "llvm.masked.load.v16f32.p0",
                         ir.FunctionType(_FLOATS, [_FLOATS.as_pointer(), _I32, _MASK, _FLOATS]),
                         [at(a_t, args[5], _FLOATS), _I32(4), mask, ir.Constant(_FLOATS, [1.0] * LANES)])
        factor = builder.fmul(_splat(builder, args[6], _FLOATS), absmax)  # (absmax_x · 1/127²) · absmax_w[n]
        _masked(builder, "llvm.masked.store.v16f32.p0",
                ir.FunctionType(ir.VoidType(), [_FLOATS, _FLOATS.as_pointer(), _I32, _MASK]),
                [builder.fmul(builder.sitofp(corrected, _FLOATS), factor), at(y_t, args[0], _FLOATS), _I32(4), mask])
        return context.get_dummy_value()

    return types.none(y, n0, count, sums, w_row_sums, absmax_w, scale), codegen


# -- kernels ---------------------------------------------------------------------------------------------------
@njit(inline="always")
def _corrected(sum_u8, row_sum):
    """Σ x·w from Σ (x + 128)·w (wrapped int32) and Σ w: exact modulo 2^32, so exact where the result fits."""
    return np.int32(np.int64(sum_u8) - OFFSET * np.int64(row_sum))


@njit(inline="always")
def _offset_row(x_u8, m, K):
    """Row m of x_u8 holds int8 values (two's complement bytes) in [0, K): add 128 to each (xor of the sign bit),
    and set the padding x_u8[m, K:] to 128, the offset zero (its weights are 0 or masked off)."""
    for k in range(K):
        x_u8[m, k] ^= OFFSET
    for k in range(K, x_u8.shape[1]):
        x_u8[m, k] = OFFSET


@njit(parallel=True, cache=True)
def quantize_rows(x, skip, x_u8, absmax):
    """``_numba_cpu.quantize_rows`` into offset activations: x_u8 (M, K rounded up) = the int8 values + 128 (the
    same int8 values: the same rounding code writes them), in the same pass over each row."""
    for m in prange(x.shape[0]):
        _quantize_row(x, m, skip, x_u8, absmax)
        _offset_row(x_u8, m, x.shape[1])


@njit(inline="always")
def _dot_row(x_u8, m, w_i8_t, n):
    """Σ_k (x[m, k] + 128) · w[n, k] over one weight row (wrapped int32); x_u8 rows padded to 64 bytes. Four
    independent chains of ``vpdpbusd`` over consecutive vectors of the row (a single chain waits for each
    instruction's result before the next), summed at the end."""
    K = w_i8_t.shape[1]
    row_bytes = x_u8.shape[1]
    full = K - K % VECTOR_BYTES
    quads = full - full % (4 * VECTOR_BYTES)
    x0, w0 = m * row_bytes, n * K
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    for k in range(0, quads, 4 * VECTOR_BYTES):
        a0 = vdpbusd(a0, vload(x_u8, x0 + k), vload(w_i8_t, w0 + k))
        a1 = vdpbusd(a1, vload(x_u8, x0 + k + VECTOR_BYTES), vload(w_i8_t, w0 + k + VECTOR_BYTES))
        a2 = vdpbusd(a2, vload(x_u8, x0 + k + 2 * VECTOR_BYTES), vload(w_i8_t, w0 + k + 2 * VECTOR_BYTES))
        a3 = vdpbusd(a3, vload(x_u8, x0 + k + 3 * VECTOR_BYTES), vload(w_i8_t, w0 + k + 3 * VECTOR_BYTES))
    for k in range(quads, full, VECTOR_BYTES):
        a0 = vdpbusd(a0, vload(x_u8, x0 + k), vload(w_i8_t, w0 + k))
    if full < K:
        a1 = vdpbusd(a1, vload(x_u8, x0 + full), vload_first(w_i8_t, w0 + full, K - full))
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(parallel=True, cache=True)
def split_gemv(x, threshold, w_i8_t, absmax_w, w_row_sums, y, flags):
    """``_numba_cpu.split_gemv`` with the int32 dot products on ``vpdpbusd``: the same outlier scan, quantization
    and float epilogue (shared code), so the results are bit-identical; the weights are read once, in order, one
    row at a time (``_dot_row``: four chains of ``vpdpbusd`` along the row, so one stream per thread).

    One row at a time with four chains against four rows at once (one chain each; v2, the Xeon's choice against a
    single chain), 2-vCPU AMD EPYC (Zen 4, 32 MiB L3, KVM): two threads, weights from DRAM (copies called in turn),
    four outlier features, the two kernels alternating call by call in one process, medians of 150-600 calls, in
    three or four runs while the VM's all-core read moved between 25 and 36 GB/s: 2048² 0.41-0.64 -> 0.16-0.33 ms
    (faster by 1.9-2.6x in each run), 4096² (one run) 1.46 -> 0.96 ms, 8192² 2.80-4.79 -> 2.43-4.17 ms (one more
    run: 2.75 against 2.82). ``_numba_cpu``'s loop ran as fast as one row with four chains."""
    M, K = x.shape
    N = w_i8_t.shape[0]
    cols, x_o, x_i8, absmax_x = _gemv_prologue(x, threshold, flags)
    row_bytes = (K + VECTOR_BYTES - 1) // VECTOR_BYTES * VECTOR_BYTES
    x_u8 = np.empty((M, row_bytes), dtype=np.uint8)  # (M, K rounded up to 64)
    for m in range(M):
        for k in range(K):
            x_u8[m, k] = x_i8[m, k]  # the two's complement byte
        _offset_row(x_u8, m, K)
    for block in prange((N + GEMV_BN - 1) // GEMV_BN):
        start, stop = block * GEMV_BN, min(block * GEMV_BN + GEMV_BN, N)
        # _gemv_output's two halves taken apart (as in rows._rows_vnni): the block's outputs dequantized, then the
        # outlier products where there is an outlier feature, the block's rows still in L2. Per row instead, with
        # four outlier features, 8192² took 2.67 against 2.33 ms (2048²: 0.375 against 0.341), alternating call
        # by call (the machine of the docstring); without outliers 2.38 ms
        for n in range(start, stop):
            for m in range(M):
                y[m, n] = _dequantized(_corrected(_dot_row(x_u8, m, w_i8_t, n), w_row_sums[n]), m, n, absmax_x,
                                       absmax_w)
        if cols.size:
            for n in range(start, stop):
                for m in range(M):
                    y[m, n] = _plus_outliers(y[m, n], m, n, absmax_w, x_o, cols, w_i8_t)


@njit(cache=True)
def pack_panel(w_i8_t, p, panel):
    """panel[q, j] = the 4 bytes w[p·NR + j, 4q : 4q + 4] as one int32, zero past N and K: panel p, (Kq, NR)."""
    N, K = w_i8_t.shape
    Kq = panel.shape[0]
    full = K // 4
    rows = min(NR, N - p * NR)
    for q in range(full):  # q outer: the stores run in order, the 64 rows' lines stay in L1 for 16 steps
        for j in range(rows):
            panel[q, j] = load_int32(w_i8_t, (p * NR + j) * K + 4 * q)
    if full < Kq:  # the last, partial group of 4 k, zero-padded
        for j in range(rows):
            tail = np.int64(0)
            for r in range(K - 4 * full):
                tail |= (np.int64(w_i8_t[p * NR + j, 4 * full + r]) & 0xFF) << (8 * r)
            panel[full, j] = np.int32(tail)
    for q in range(Kq):  # outputs past N
        for j in range(rows, NR):
            panel[q, j] = 0


@njit(parallel=True, cache=True)
def gemm(x_u8, w_i8_t, w_row_sums, absmax_x, absmax_w, out, panels):
    """out[m, n] = Σ_k x[m, k] · w[n, k] (int32, exact), from offset activations x_u8 (M, 4·Kq) and the int8
    weight (N, K); dequantized in the epilogue into a float32 ``out`` when absmax_x (M,) and absmax_w (N,) are
    given (not empty), as ``_numba_cpu.dequantize`` computes it.

    The tasks are (panel of NR outputs, run of rows of X), panel-major, in one contiguous share per worker of
    ``panels`` (T, Kq, NR) int32: each worker packs its panel into its own slot (K·NR bytes, which stay in L2) when
    its next task starts another panel, then passes its rows of X over it in micro-tiles. A panel's rows of X are
    split into runs only when there are fewer than two panels per worker."""
    M = x_u8.shape[0]
    N = out.shape[1]
    n_workers = panels.shape[0]
    P = (N + NR - 1) // NR
    blocks_m = (M + BM - 1) // BM
    runs = min(blocks_m, max(1, (2 * n_workers + P - 1) // P))  # runs of rows of X per panel
    blocks_per_run = (blocks_m + runs - 1) // runs
    n_tasks = P * runs
    inv = np.float32(1.0 / (QMAX * QMAX))
    dequantize = absmax_x.size > 0
    for worker in prange(n_workers):
        panel = panels[worker]  # (Kq, NR)
        tile = np.empty((MR, NR), dtype=np.int32)  # (MR, NR) wrapped sums of (x + 128)·w
        packed = -1  # the panel in this worker's slot
        for task in range(worker * n_tasks // n_workers, (worker + 1) * n_tasks // n_workers):
            p, run = task // runs, task % runs
            if p != packed:
                pack_panel(w_i8_t, p, panel)
                packed = p
            n0 = p * NR
            m_start = run * blocks_per_run * BM
            for m0 in range(m_start, min(m_start + blocks_per_run * BM, M), MR):
                micro_tile(x_u8, m0, panel, tile)
                for i in range(min(MR, M - m0)):
                    m = m0 + i
                    if dequantize:
                        row_scale = absmax_x[m] * inv
                        for j in range(min(NR, N - n0)):
                            c = _corrected(tile[i, j], w_row_sums[n0 + j])
                            out[m, n0 + j] = np.float32(c) * (row_scale * absmax_w[n0 + j])
                    else:
                        for j in range(min(NR, N - n0)):
                            out[m, n0 + j] = _corrected(tile[i, j], w_row_sums[n0 + j])


@njit(parallel=True, cache=True)
def row_sums(w_i8_t, sums):
    """sums[n] = Σ_k w[n, k] (int32: |Σ| <= 128·K fits for every K that the int32 products allow)."""
    N, K = w_i8_t.shape
    for n in prange(N):
        acc = 0
        for k in range(K):
            acc += np.int32(w_i8_t[n, k])
        sums[n] = acc


def offset_activations(x_i8):
    """x_i8 (M, K) int8 as the GEMM's operand: x + 128 as uint8, (M, K rounded up to 4), padded with 128."""
    M, K = x_i8.shape
    x_u8 = np.full((M, (K + 3) // 4 * 4), OFFSET, dtype=np.uint8)  # (M, K rounded up to 4)
    np.bitwise_xor(x_i8.view(np.uint8), np.uint8(OFFSET), out=x_u8[:, :K])
    return x_u8


def gemm_i8(x_u8, w_i8_t, w_row_sums, out, absmax_x=None, absmax_w=None):
    """out (M, N) = x (M, K) · w_i8_tᵀ from the offset activations x_u8 (M, K rounded up to 4): exact int32 sums
    into an int32 ``out``, or, given the absmax of the rows of x and of the outputs, dequantized into a float32
    ``out``. Each worker packs the weight's panels it needs into its own slot as it goes (``gemm``)."""
    Kq = x_u8.shape[1] // 4
    panels = np.empty((numba.get_num_threads(), Kq, NR), dtype=np.int32)  # (T, Kq, NR): one panel per worker
    if absmax_x is None:
        absmax_x = absmax_w = np.empty(0, dtype=np.float32)
    gemm(x_u8, w_i8_t, w_row_sums, absmax_x, absmax_w, out, panels)
