"""LLM.int8()'s exact int8 dot product on AVX2 for CPUs without AVX512-VNNI (AMD Zen 2 and 3, Intel before Ice Lake):
the row products of the decode GEMV (``rows``), of ``Int8Linear`` on a few rows (``_numba_cpu.split_gemv``) and of
the int8 GEMM (``gemm_i8``, where no activation is −128).

LLVM vectorizes the plain int8 loop (int8 widened to int32) into ``vpmovsxbw``/``vpmovzxbw`` pairs and 128-bit
``vpmaddwd``: per 8 bytes of a weight row two widenings, one multiply-add and one add. AVX2 has a byte
multiply-add, ``vpmaddubsw`` (Intel SDM vol. 2B, "PMADDUBSW"): 16 int16 lanes, each the sum of two products of an
unsigned byte of its first operand and a signed byte of its second, saturated to int16. It takes one unsigned and
one signed operand, so the signed pair x (activations), w (weights) is rewritten with ``vpabsb`` and ``vpsignb``
(SDM vol. 2A, "PABSB/PABSW/PABSD", "PSIGNB/PSIGNW/PSIGND"):

    x · w = |w| · (x · sign(w))        (|w| as an unsigned byte; x · sign(w) = x, −x or 0)

then ``vpmaddwd`` against 16 ones sums the int16 pairs into 8 int32 lanes (SDM vol. 2B, "PMADDWD"): 32 products in
five instructions where the widening loop takes sixteen.

Exact where x ∈ [−127, 127]: then x · sign(w) never wraps (−x of −128 would), each product lies in
[−128·127, 128·127] (|w| ≤ 128), a pair of them in [−32512, 32512], and ``vpmaddubsw`` never saturates. The
activations come from ``_numba_cpu._quantize_row`` (round(x · 127 / absmax): |q| ≤ 127); the weights may be any
int8, −128 included. The int32 lanes wrap, so a sum is exact modulo 2^32 and, where its value fits (K <=
MAX_EXACT_K), exact: bit-identical to the loop, ``_vnni`` and the int64 oracle.

Chosen where the target Numba compiles for has AVX2 (``AVAILABLE``; ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``
override the host's, as for all of Numba's code), and not where ``_vnni`` runs. Elsewhere the loop runs (LLVM
cannot select the 256-bit intrinsics without the feature).

Versions (2-vCPU AMD EPYC, Zen 3 (family 25, model 1), KVM, no AVX-512):
  v1 (this file): ``dot``, one weight row at a time, two chains of ``vpmaddubsw``/``vpmaddwd`` over 64 bytes per
      step, a scalar loop for the last K mod 32 bytes (``split_gemv``'s products). K = N = 2048 on one thread,
      medians over 64 weights called in turn, against LLVM's loop: from DRAM 0.33 -> 0.29 ms (12.6 -> 14.7 GB/s),
      the same weight again (from L3) 0.214 -> 0.131 ms. The decode rows read four rows at once with these
      intrinsics (``rows._rows_avx2``: from DRAM 25.9-26.8 GB/s on one thread; its figures there).
  v2: ``gemm_i8``, ``_numba_cpu.gemm_i8``'s tiles with four weight rows at once against each row of X. Two threads,
      medians of 7 calls in three rounds against the loop and NumPy's float32 sgemm of the same shape: 128 × 1024 ×
      1024 4.07-8.74 -> 1.41-2.72 ms (sgemm 1.84-1.95), 256 × 576 × 1536 11.5-12.4 -> 2.90-4.93 (sgemm 2.67-2.89),
      512 × 2048 × 2048 55.2-67.5 -> 23.2-24.6 (sgemm 23.6-26.6): about NumPy's sgemm, from 0.2-0.45 of it.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .._common.numba_cpu import byte_address, is_c_array, target_features

REQUIRED_FEATURES = ("avx2",)  # 256-bit integer vpmaddubsw, vpmaddwd, vpabsb, vpsignb
VECTOR_BYTES = 32  # one ymm register
LANES = 8  # int32 lanes of a ymm register

AVAILABLE = set(REQUIRED_FEATURES) <= target_features()


# -- a ymm register as a Numba value -----------------------------------------------------------------------------
class Int32x8(types.Type):
    """A <8 x i32> LLVM vector: 8 int32 sums, or 32 bytes to multiply."""

    def __init__(self):
        super().__init__(name="int32x8")


int32x8 = Int32x8()
_VEC = ir.VectorType(ir.IntType(32), LANES)
_BYTES = ir.VectorType(ir.IntType(8), VECTOR_BYTES)
_PAIRS = ir.VectorType(ir.IntType(16), VECTOR_BYTES // 2)


@register_model(Int32x8)
class _Int32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _call(builder, name, return_type, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(return_type, [a.type for a in args]), name)
    return builder.call(fn, args)


@intrinsic
def yzero(typingctx):
    """8 int32 zeros."""
    return int32x8(), lambda context, builder, signature, args: ir.Constant(_VEC, None)


@intrinsic
def yload(typingctx, array, index):
    """The 32 bytes from &array.flat[index] on (unaligned)."""
    if not (is_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = byte_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=1)

    return int32x8(array, index), codegen


@intrinsic
def yflip(typingctx, v):
    """Each byte xor 0x80: offset activations x + 128 (``_vnni``'s operand) back to the int8 values x."""
    if v != int32x8:
        return None

    def codegen(context, builder, signature, args):
        return builder.xor(args[0], ir.Constant(_VEC, [0x80808080 - 2**32] * LANES))

    return int32x8(v), codegen


@intrinsic
def ydot(typingctx, acc, x, w):
    """acc[i] + Σ_{j<4} int8(x[4i + j]) · int8(w[4i + j]) for each of the 8 lanes, wrapping; exact where no byte
    of x is −128 (the module's docstring)."""
    if not (acc == int32x8 and x == int32x8 and w == int32x8):
        return None

    def codegen(context, builder, signature, args):
        x_b, w_b = builder.bitcast(args[1], _BYTES), builder.bitcast(args[2], _BYTES)
        w_abs = _call(builder, "llvm.abs.v32i8", _BYTES, [w_b, ir.Constant(ir.IntType(1), 0)])  # |w|, −128 → 0x80
        x_signed = _call(builder, "llvm.x86.avx2.psign.b", _BYTES, [x_b, w_b])  # x · sign(w)
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _PAIRS, [w_abs, x_signed])  # (16,) int16
        sums = _call(builder, "llvm.x86.avx2.pmadd.wd", _VEC, [pairs, ir.Constant(_PAIRS, [1] * (VECTOR_BYTES // 2))])
        return builder.add(args[0], sums)

    return int32x8(acc, x, w), codegen


@intrinsic
def yadd(typingctx, a, b):
    """a + b lane by lane (8 int32, wrapping)."""
    if not (a == int32x8 and b == int32x8):
        return None
    return int32x8(a, b), lambda context, builder, signature, args: builder.add(args[0], args[1])


@intrinsic
def ysum(typingctx, v):
    """Σ of the 8 int32 lanes, wrapping."""
    if v != int32x8:
        return None

    def codegen(context, builder, signature, args):
        return _call(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), args)

    return types.int32(v), codegen


@njit(inline="always")
def dot(x, x0, w, w0, K, offset):
    """Σ_{k<K} (x.flat[x0 + k] − offset) · w.flat[w0 + k] as a wrapped int32: x int8 (``offset`` 0) or the offset
    activations of ``_vnni`` in uint8 (``offset`` 128), w int8; C-contiguous arrays. Two chains of 32 bytes,
    then the last K mod 32 products one by one."""
    full = K - K % VECTOR_BYTES
    pairs = full - full % (2 * VECTOR_BYTES)
    a0, a1 = yzero(), yzero()
    for k in range(0, pairs, 2 * VECTOR_BYTES):
        a0 = ydot(a0, _activations(x, x0 + k, offset), yload(w, w0 + k))
        a1 = ydot(a1, _activations(x, x0 + k + VECTOR_BYTES, offset), yload(w, w0 + k + VECTOR_BYTES))
    for k in range(pairs, full, VECTOR_BYTES):
        a0 = ydot(a0, _activations(x, x0 + k, offset), yload(w, w0 + k))
    tail = 0  # int64 in Numba; truncated with the rest
    for k in range(full, K):
        tail += (np.int64(x.flat[x0 + k]) - offset) * np.int64(w.flat[w0 + k])
    return np.int32(np.int64(ysum(yadd(a0, a1))) + tail)


@njit(inline="always")
def _activations(x, index, offset):
    """32 activation bytes as int8 values: as stored, or the offset ones flipped back."""
    v = yload(x, index)
    return yflip(v) if offset else v


@njit(parallel=True, cache=True)
def gemm_i8(x_i8, w_i8_t, out, BM, BN):
    """``_numba_cpu.gemm_i8`` on ``vpmaddubsw``: out[m, n] = Σ_k x_i8[m, k] · w_i8_t[n, k] in int32, exact where no
    byte of x_i8 is −128 (the caller checks) and K <= MAX_EXACT_K. The same tiles of BM rows of X by BN weight rows
    (the tile's weight rows stay in L2 while its rows of X pass); within a tile four weight rows at once against one
    row of X, so that each load of x serves four rows."""
    M, K = x_i8.shape
    N = w_i8_t.shape[0]
    full = K - K % VECTOR_BYTES
    tiles_n = (N + BN - 1) // BN
    tiles_m = (M + BM - 1) // BM
    for tile in prange(tiles_m * tiles_n):
        m0 = (tile // tiles_n) * BM
        n0 = (tile % tiles_n) * BN
        n1 = min(n0 + BN, N)
        quads = n0 + (n1 - n0) // 4 * 4
        for m in range(m0, min(m0 + BM, M)):
            x0 = m * K
            for n in range(n0, quads, 4):
                a0, a1, a2, a3 = yzero(), yzero(), yzero(), yzero()
                p0 = n * K
                for k in range(0, full, VECTOR_BYTES):
                    xv = yload(x_i8, x0 + k)
                    a0 = ydot(a0, xv, yload(w_i8_t, p0 + k))
                    a1 = ydot(a1, xv, yload(w_i8_t, p0 + K + k))
                    a2 = ydot(a2, xv, yload(w_i8_t, p0 + 2 * K + k))
                    a3 = ydot(a3, xv, yload(w_i8_t, p0 + 3 * K + k))
                t0 = t1 = t2 = t3 = 0  # the last K mod 32 products, in int64, wrapped with the rest
                for k in range(full, K):
                    xk = np.int64(x_i8[m, k])
                    t0 += xk * w_i8_t[n, k]
                    t1 += xk * w_i8_t[n + 1, k]
                    t2 += xk * w_i8_t[n + 2, k]
                    t3 += xk * w_i8_t[n + 3, k]
                out[m, n] = np.int32(ysum(a0) + t0)
                out[m, n + 1] = np.int32(ysum(a1) + t1)
                out[m, n + 2] = np.int32(ysum(a2) + t2)
                out[m, n + 3] = np.int32(ysum(a3) + t3)
            for n in range(quads, n1):  # the tile's last n1 − n0 mod 4 rows
                out[m, n] = dot(x_i8, x0, w_i8_t, n * K, K, 0)
