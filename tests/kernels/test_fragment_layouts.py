"""The ldmatrix addressing of the CUDA C kernels, emulated in NumPy (no GPU here): each lane's row address, as the
kernels compute it, fed to an emulation of ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`` (PTX ISA,
"Warp-level matrix load instruction: ldmatrix"), must yield exactly the mma.sync fragments of the tile the kernel
means (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" and "for mma.m16n8k32" with .s8), and
the 8 rows of each matrix must fall in distinct shared-memory banks (32 banks of 4 bytes).

The address formulas below are copied from ``flash_attention.cu`` and ``int8_matmul.cu`` (a change there must be
made here too); the layouts they are checked against are the PTX ISA's, written independently in
``a_matrix``/``b_matrix``. This checks the index math only: a GPU run (``python -m simulator gpu-check``) checks
the kernels themselves.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attn import _cupy as attn_tier2
from kernels.int8 import _cupy as int8_tier2

LANES = np.arange(32)
G, TIG = LANES // 4, LANES % 4  # groupID and thread-in-group


def ldmatrix_x4(smem, addrs, trans=False, unit=2):
    """Emulated ldmatrix.x4 on a flat shared-memory array: ``addrs[l]`` is lane l's row start (in elements of
    ``smem``), rows of 16 bytes (``16 // itemsize`` elements). Returns (32 lanes, 4 registers, values per register):
    lane l gets (row l / 4, the l % 4-th 32-bit word) of matrix i, or with ``trans`` (b16 only) the two values
    (rows 2·(l % 4) and 2·(l % 4) + 1, column l / 4)."""
    per_row = 16 // smem.itemsize
    per_word = 4 // smem.itemsize
    out = np.empty((32, 4, per_word), dtype=smem.dtype)
    for i in range(4):
        m = np.stack([smem[a:a + per_row] for a in addrs[8 * i:8 * i + 8]])  # (8 rows, 16 bytes)
        for lane in range(32):
            if trans:
                out[lane, i] = m[2 * (lane % 4):2 * (lane % 4) + 2, lane // 4]
            else:
                out[lane, i] = m[lane // 4, per_word * (lane % 4):per_word * (lane % 4) + per_word]
    return out


def banks_conflict_free(addrs, itemsize):
    """Each matrix's 8 rows of 16 bytes cover 32 distinct banks (4-byte banks, 32 of them)."""
    for i in range(4):
        banks = [(a * itemsize // 4 + w) % 32 for a in addrs[8 * i:8 * i + 8] for w in range(4)]
        if len(set(banks)) != 32:
            return False
    return True


def a_matrix(frag, k_step):
    """The 16 × k_step A tile that mma's A fragments (32 lanes, 4 registers, values) hold, row-major."""
    per = frag.shape[2]
    a = np.empty((16, k_step), dtype=frag.dtype)
    half = k_step // 2
    for lane in range(32):
        c = per * TIG[lane]
        a[G[lane], c:c + per] = frag[lane, 0]
        a[G[lane] + 8, c:c + per] = frag[lane, 1]
        a[G[lane], half + c:half + c + per] = frag[lane, 2]
        a[G[lane] + 8, half + c:half + c + per] = frag[lane, 3]
    return a


def b_matrix(frag, k_step):
    """The k_step × 8 B tile that mma's B fragments (32 lanes, 2 registers, values) hold."""
    per = frag.shape[2]
    b = np.empty((k_step, 8), dtype=frag.dtype)
    half = k_step // 2
    for lane in range(32):
        k = per * TIG[lane]
        b[k:k + per, G[lane]] = frag[lane, 0]
        b[half + k:half + k + per, G[lane]] = frag[lane, 1]
    return b


@pytest.mark.parametrize("d", attn_tier2.HEAD_DIMS)
def test_flash_q_k_v_fragments(rng, d):
    BR, BC = attn_tier2.BR, attn_tier2.BC
    LD = d + 8  # Rows<D>::LD: rows padded by 16 bytes
    q_s = rng.integers(0, 2**16, (BR, LD), dtype=np.uint16)  # (BR, LD) 16-bit patterns
    k_s = rng.integers(0, 2**16, (BC, LD), dtype=np.uint16)  # (BC, LD)
    v_s = rng.integers(0, 2**16, (BC, LD), dtype=np.uint16)  # (BC, LD)
    mat, mat_row = LANES // 8, LANES % 8
    for warp in range(BR // 16):
        for kk in range(d // 16):  # Q: (warp·16 + l % 16) · LD + kk·16 + (l / 16)·8
            addrs = (warp * 16 + LANES % 16) * LD + kk * 16 + (LANES // 16) * 8
            frag = ldmatrix_x4(q_s.ravel(), addrs)
            assert np.array_equal(a_matrix(frag, 16), q_s[warp * 16:warp * 16 + 16, kk * 16:kk * 16 + 16])
            assert banks_conflict_free(addrs, 2)
    for nt in range(BC // 8):
        for kk in range(0, d // 16, 2):  # K: (nt·8 + l % 8) · LD + kk·16 + (l / 8)·8; B[k][n] = K[n][k]
            addrs = (nt * 8 + mat_row) * LD + kk * 16 + mat * 8
            frag = ldmatrix_x4(k_s.ravel(), addrs)
            for step, regs in ((kk, frag[:, 0:2]), (kk + 1, frag[:, 2:4])):
                assert np.array_equal(b_matrix(regs, 16), k_s[nt * 8:nt * 8 + 8, step * 16:step * 16 + 16].T)
            assert banks_conflict_free(addrs, 2)
    for kk in range(BC // 16):
        for dt in range(0, d // 8, 2):  # V, .trans: (kk·16 + (l / 8 % 2)·8 + l % 8) · LD + dt·8 + (l / 16)·8
            addrs = (kk * 16 + (mat % 2) * 8 + mat_row) * LD + dt * 8 + (mat // 2) * 8
            frag = ldmatrix_x4(v_s.ravel(), addrs, trans=True)
            for col, regs in ((dt, frag[:, 0:2]), (dt + 1, frag[:, 2:4])):
                assert np.array_equal(b_matrix(regs, 16), v_s[kk * 16:kk * 16 + 16, col * 8:col * 8 + 8])
            assert banks_conflict_free(addrs, 2)


def test_int8_gemm_fragments_give_the_exact_product(rng):
    BM, BN, BK = int8_tier2.BM, int8_tier2.BN, int8_tier2.BK
    LD = BK + 16
    a_s = rng.integers(-127, 128, (BM, LD), dtype=np.int8)  # (BM, LD) one stage of X_i8
    w_s = rng.integers(-127, 128, (BN, LD), dtype=np.int8)  # (BN, LD) one stage of W_t
    WM, WN = BM // 2, BN // 4
    mat, mat_row = LANES // 8, LANES % 8
    for warp in range(int8_tier2.GEMM_THREADS // 32):
        wm, wn = (warp // 4) * WM, (warp % 4) * WN
        for kk in range(0, BK, 32):
            a_tiles = []
            for mt in range(WM // 16):  # A: (wm + mt·16 + l % 16) · LD + kk + (l / 16)·16
                addrs = (wm + mt * 16 + LANES % 16) * LD + kk + (LANES // 16) * 16
                a = a_matrix(ldmatrix_x4(a_s.ravel(), addrs), 32)
                assert np.array_equal(a, a_s[wm + mt * 16:wm + mt * 16 + 16, kk:kk + 32])
                assert banks_conflict_free(addrs, 1)
                a_tiles.append(a)
            for nt in range(0, WN // 8, 2):  # B: (wn + nt·8 + (l / 16)·8 + l % 8) · LD + kk + (l / 8 % 2)·16
                addrs = (wn + nt * 8 + (mat // 2) * 8 + mat_row) * LD + kk + (mat % 2) * 16
                frag = ldmatrix_x4(w_s.ravel(), addrs)
                assert banks_conflict_free(addrs, 1)
                for t, regs in ((nt, frag[:, 0:2]), (nt + 1, frag[:, 2:4])):
                    b = b_matrix(regs, 32)  # (32 k, 8 n) = W_t[n, k]ᵀ
                    n0 = wn + t * 8
                    assert np.array_equal(b, w_s[n0:n0 + 8, kk:kk + 32].T)
                    c = a_tiles[0].astype(np.int32) @ b.astype(np.int32)  # the mma's s32 result, (16, 8)
                    exact = a_s[wm:wm + 16, kk:kk + 32].astype(np.int64) @ w_s[n0:n0 + 8, kk:kk + 32].T
                    assert np.array_equal(c, exact)


def test_the_tiles_fit_the_devices_shared_memory():
    """Dynamic shared memory per block against the opt-in limits: 163 KB on sm_80, 227 KB on sm_90 (CUDA C++
    Programming Guide, "Technical Specifications per Compute Capability"); printed for the resource report."""
    report = {f"flash d={d}": attn_tier2.flash_shared_bytes(d) for d in attn_tier2.HEAD_DIMS}
    report["int8 GEMM"] = int8_tier2.gemm_shared_bytes()
    print("dynamic shared memory per block:", ", ".join(f"{k} {v} B" for k, v in report.items()))
    assert max(report.values()) <= 163 * 1024
