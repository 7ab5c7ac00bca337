"""LLM.int8()'s decode GEMV over int8 weights packed in panels of 16 rows, the operand layout of ``vpdpbusd``: the
fused decode step's int8 products where they run on that instruction (``PANELS``; ``kernels.decode``).
``int8_panel_rows`` computes any run of outputs from an input prepared by ``kernels.int8.rows.prepare``, bit for bit
what ``kernels.int8.rows.int8_rows`` computes from the same weight's rows (exact int32 sums, then the same float
epilogue).

The layout: panel p holds rows 16p .. 16p + 15, group q of 4 k after group q − 1, and in a group the 4 bytes of
each of the 16 rows in turn. Byte r of row j of group q of panel p is w[16p + j, 4q + r]; rows past N and k past K
are zeros. ``pack`` returns it as an (N rounded up to 16, K rounded up to 4) int8 array whose rows 16p .. 16p + 15
are panel p's bytes (not rows of the weight), so a range of whole panels is a range of its rows.

Why: one 64-byte load of a panel holds 4 k of 16 outputs, so one ``vpdpbusd`` against the input's 4 bytes of those
k, broadcast to the 16 lanes, adds 64 products into 16 output sums at once: each thread streams one run of
consecutive bytes, no horizontal sum per output. Row by row (``rows._rows_vnni``) four rows at once keep four streams
per thread, and each output ends in a sum across its vector's 16 lanes. Random int8 weights of SmolLM2-135M's
shapes (134 MB: 30 blocks and the int8 LM head, in the order a token reads them, each linear's outputs split in two
halves on two threads, no outlier feature), the two kernels in turn in one process, 16 rounds, three runs (2-vCPU
AMD EPYC, Zen 4, KVM): rows 25.6, 24.3, 29.1 GB/s (medians), panels 29.8, 28.0, 37.8, faster in 48 rounds of 48; a
plain read of the same bytes 31.9, 29.2, 42.2.

The portable path (``path_marker(False)``) computes the same sums with a loop over the same layout, for the tests;
LLVM does not vectorize it, and over SmolLM2's shapes on one thread it ran about 9x slower than the row kernel's
loop (helper review, 2-vCPU AMD EPYC). So the layout is chosen with the path: ``PANELS`` (the CPU has AVX512-VNNI,
as Numba sees it) packs panels, elsewhere the weights stay in rows, and ``layout_rows`` runs either kernel.

Versions:
  v1 (this file): the panels, their ``vpdpbusd`` kernel (four chains over consecutive groups of k, the 16 sums
      stored with a masked store, the outputs finished per panel, the outlier products 16 outputs at a time from
      the panel's bytes) and the portable loop. The reference is the row kernels' (``_numba_cpu.split_gemv``):
      the same bits.
  v2: a panel's outputs finished on 16 lanes (``_vnni.dequantized16``) instead of one by one, the outlier column's
      16 weights read in one load (``plus_panel_outliers16``) instead of 16, and no view of the weight or the
      outputs made per call. A thread that streams its weights from DRAM issues its loads only as far ahead as its
      instructions reach, and the epilogue's scalar work per output stood beside a panel's 144 ``vpdpbusd`` at
      K = 576: the linear steps of SmolLM2's int8 + int8 head step on two threads ran in 0.94 of their time with
      SwiGLU taken out of them and in 0.86 with the epilogues too (wrong values, a measurement only, in turn in one
      process). 256 MiB of panels at K = 576 from DRAM, one thread, calls of 128 rows, v1 and v2 in turn in one
      process (8 rounds, 2-vCPU AMD EPYC, Zen 4, KVM): 24.6 -> 28.3 GB/s (medians) without outliers, 23.0 -> 27.2
      with 7, faster in every round; the same bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .._common.numba_cpu import byte_address, is_c_array
from .._common.prefetch import prefetch_rows
from . import _vnni
from ._numba_cpu import QMAX, _dequantized, round_to_float16
from .rows import ROWS_AT_ONCE, int8_rows
from ._vnni import (LANES, _data, _I32, _outlier_products, _splat, _VEC, _corrected,
                    dequantized16, int32x16, vadd, vdpbusd, vload, vzero)

PANEL_ROWS = LANES  # rows of a panel: one output per int32 lane of a zmm register
GROUP = 4  # k per lane of one vpdpbusd (Intel SDM vol. 2C, "VPDPBUSD": four byte products per dword)
PANEL_LINE = PANEL_ROWS * GROUP  # bytes of one group of 4 k of a panel's 16 rows: one 64-byte load
PANELS = _vnni.AVAILABLE  # the layout that the fused decode step packs its int8 weights in: panels where the
# products run on vpdpbusd, rows elsewhere (the portable loop over panels is ~9x slower than over rows). Read when a
# step is made; a product path forced afterwards (``_api.USE_VNNI``, as the tests do) keeps it: the same values


def panel_shape(N: int, K: int) -> tuple[int, int]:
    """The shape of ``pack``'s array for an (N, K) weight: N rounded up to 16, K rounded up to 4."""
    return -(-N // PANEL_ROWS) * PANEL_ROWS, -(-K // GROUP) * GROUP


def pack(w_i8):
    """The (N, K) int8 weight w_i8 in panels of 16 rows (the module's docstring): a new (N rounded up to 16, K
    rounded up to 4) int8 array."""
    N, K = w_i8.shape
    Np, Kp = panel_shape(N, K)
    padded = np.zeros((Np, Kp), dtype=np.int8)  # (Np, Kp) the rows, zero past N and K
    padded[:N, :K] = w_i8
    # [p, j, q, r] = w[16p + j, 4q + r] -> [p, q, j, r]
    panels = padded.reshape(Np // PANEL_ROWS, PANEL_ROWS, Kp // GROUP, GROUP).transpose(0, 2, 1, 3)  # (P, Kq, 16, 4)
    return np.ascontiguousarray(panels).reshape(Np, Kp)  # (Np, Kp): panel p in rows 16p .. 16p + 15


def unpack(panels, N, K):
    """The (N, K) rows of a packed weight (``pack``'s inverse): a new array."""
    Np, Kp = panels.shape
    rows = panels.reshape(Np // PANEL_ROWS, Kp // GROUP, PANEL_ROWS, GROUP).transpose(0, 2, 1, 3)  # (P, 16, Kq, 4)
    return np.ascontiguousarray(rows.reshape(Np, Kp)[:N, :K])


@intrinsic
def vsplat4(typingctx, array, index):
    """The 4 bytes from &array.flat[index] on (one int32, unaligned) in each of the 16 lanes."""
    if not (is_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        p = byte_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return _splat(builder, builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _VEC)

    return int32x16(array, index), codegen


@intrinsic
def plus_panel_outliers16(typingctx, y, n0, count, absmax_w, x_o, cols, J, w_p, first):
    """``_vnni.plus_outliers16`` for a panel whose first byte is w_p.flat[first] (a C-contiguous int8 array): the
    same operations per lane, so the same bits, with the 16 weights of an outlier column c taken from the one 64-byte
    group that holds them (byte c % 4 of each lane of group c // 4: a load and two shifts) instead of 16 loads of a
    byte. Lanes past ``count`` take a later row of the panel (padding past N, or outputs past the range) and write
    nothing.

    Why: SmolLM2's int8 LM head meets ~7 outlier features a token (6.9 on average over 48 tokens of ``generate``);
    with 16 byte loads per feature, that was 112 loads a panel for the outliers beside its 144 loads of weights at
    K = 576 (``_panels_vnni``)."""
    arrays = (y, absmax_w, x_o, cols, w_p)
    if not (all(is_c_array(a) for a in arrays) and w_p.dtype == types.int8 and cols.dtype == types.int64
            and all(a.dtype == types.float32 for a in (y, absmax_w, x_o))
            and all(isinstance(i, types.Integer) for i in (n0, count, J, first))):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        first_v = context.cast(builder, args[8], signature.args[8], types.int64)
        panel = builder.gep(builder.bitcast(_data(context, builder, signature.args[7], args[7]),
                                            ir.IntType(8).as_pointer()), [first_v])

        def column(c):  # group c // 4's 64 bytes, byte c % 4 of each lane, sign-extended
            offset = builder.mul(builder.ashr(c, ir.Constant(i64, 2)), ir.Constant(i64, PANEL_LINE))
            group = builder.gep(panel, [offset])
            words = builder.load(builder.bitcast(group, _VEC.as_pointer()), align=1)  # lane l: row l's 4 bytes
            r = builder.trunc(builder.and_(c, ir.Constant(i64, GROUP - 1)), _I32)
            up = builder.sub(_I32(24), builder.mul(r, _I32(8)))  # byte r to the top, then back down with its sign
            return builder.ashr(builder.shl(words, _splat(builder, up, _VEC)), _splat(builder, _I32(24), _VEC))

        _outlier_products(context, builder, signature, args, column)
        return context.get_dummy_value()

    return types.none(y, n0, count, absmax_w, x_o, cols, J, w_p, first), codegen


@njit(cache=True)
def _panels_vnni(x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift, ahead):
    # w_p read through its flat indices (vload, plus_panel_outliers16 and prefetch take any C-contiguous array) and
    # y written by dequantized16, not through views: a view made per call counts a reference on the array's shared
    # record, an atomic update per call (v2)
    Kp = w_p.shape[1]
    Kq = Kp // GROUP
    quads = Kq - Kq % 4
    scale = absmax_x[0] * np.float32(1.0 / (QMAX * QMAX))  # _dequantized's factor of the input
    for n in range(n0, n1, PANEL_ROWS):
        count = min(PANEL_ROWS, n1 - n)
        base = (n + shift) * Kp  # the panel's first byte
        if ahead:  # the panel ROWS_AT_ONCE·ahead rows on: the bytes the row kernel's four streams keep asked for
            prefetch_rows(w_p, Kp, n + shift + ROWS_AT_ONCE * ahead, n1 + shift, PANEL_ROWS)
        # Σ_k (x + 128)·w for the panel's 16 outputs, one per lane: the input's 4 bytes of each group of k in every
        # lane against the group's 64 bytes; four independent chains over consecutive groups, summed at the end
        a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
        for q in range(0, quads, 4):
            p = base + q * PANEL_LINE
            a0 = vdpbusd(a0, vsplat4(x_u8, GROUP * q), vload(w_p, p))
            a1 = vdpbusd(a1, vsplat4(x_u8, GROUP * q + GROUP), vload(w_p, p + PANEL_LINE))
            a2 = vdpbusd(a2, vsplat4(x_u8, GROUP * q + 2 * GROUP), vload(w_p, p + 2 * PANEL_LINE))
            a3 = vdpbusd(a3, vsplat4(x_u8, GROUP * q + 3 * GROUP), vload(w_p, p + 3 * PANEL_LINE))
        for q in range(quads, Kq):
            a0 = vdpbusd(a0, vsplat4(x_u8, GROUP * q), vload(w_p, base + q * PANEL_LINE))
        # _gemv_output's two halves (as in rows._rows_vnni), 16 outputs at a time: the outputs dequantized, then the
        # outlier products where there is an outlier feature, the panel still in L1
        dequantized16(y, n, count, vadd(vadd(a0, a1), vadd(a2, a3)), w_row_sums, absmax_w, scale)
        if J:
            plus_panel_outliers16(y, n, count, absmax_w, x_o, cols, J, w_p, base)


@njit(cache=True)
def _panels_loop(x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift, ahead):
    flat = w_p.reshape(-1)
    Kp = w_p.shape[1]
    acc = np.empty(PANEL_ROWS, dtype=np.int64)  # (16,) a panel's sums of (x + 128)·w, exact in int64
    for n in range(n0, n1, PANEL_ROWS):
        count = min(PANEL_ROWS, n1 - n)
        base = (n + shift) * Kp
        acc[:] = 0
        for q in range(Kp // GROUP):
            for j in range(PANEL_ROWS):
                p = base + q * PANEL_LINE + j * GROUP
                for r in range(GROUP):
                    acc[j] += np.int64(x_u8[0, GROUP * q + r]) * np.int64(flat[p + r])
        for j in range(count):
            m = n + j
            value = _dequantized(_corrected(np.int32(acc[j]), w_row_sums[m]), 0, m, absmax_x, absmax_w)
            step = absmax_w[m] / np.float32(QMAX)  # _plus_outliers' operations, the weight read from the panel
            for i in range(J):
                c = cols[i]
                w = flat[base + (c // GROUP) * PANEL_LINE + j * GROUP + c % GROUP]
                value += x_o[0, i] * round_to_float16(np.float32(w) * step)
            y[m] = value


def int8_panel_rows(path, x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift, ahead):
    """y[n0:n1] = the split product of the prepared vector (``rows.prepare``) with outputs n0 .. n1 − 1 of the
    packed int8 weight w_p (``pack``), whose output n lies in row n + shift of w_p; n0 + shift a multiple of 16.
    absmax_w and w_row_sums are the weight's (indexed by n), y float32. ``path`` and ``ahead`` as for
    ``rows.int8_rows`` (callers pass ``rows.ROW_PREFETCH``): the ``vpdpbusd`` path asks for the panel
    ROWS_AT_ONCE·ahead rows on, the bytes that the row kernel's four streams keep asked for. Not measured: it is 0
    on AMD, where this layout was measured. It changes no value. Numba code only (an ``overload`` on ``path``'s
    dtype)."""
    raise NotImplementedError("int8_panel_rows is called from Numba code")


@overload(int8_panel_rows)
def _int8_panel_rows_overload(path, x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift,
                              ahead):
    if not isinstance(path, types.Array):
        return None
    panel_rows = _panels_vnni if path.dtype == types.uint8 else _panels_loop

    def impl(path, x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift, ahead):
        panel_rows(x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, w_row_sums, y, n0, n1, shift, ahead)

    return impl


@njit(inline="always")
def layout_rows(path, in_panels, x_u8, J, cols, x_o, absmax_x, w, absmax_w, w_row_sums, y, n0, n1, shift, ahead):
    """Outputs n0 .. n1 − 1 of an int8 weight w in panels (``in_panels``: ``int8_panel_rows``, output n in row
    n + shift of w) or in rows (``rows.int8_rows``, output n in row n of w; ``shift`` unused): the fused decode
    step's int8 products in the layout ``PANELS`` chose."""
    if in_panels:
        int8_panel_rows(path, x_u8, J, cols, x_o, absmax_x, w, absmax_w, w_row_sums, y, n0, n1, shift, ahead)
    else:
        int8_rows(path, x_u8, J, cols, x_o, absmax_x, w, absmax_w, w_row_sums, y, n0, n1, ahead)
