"""kernels.int8.panels (the decode step's int8 products over weights packed in panels of 16 rows) against the
blocked GEMV of the same weight's rows, bit for bit, on both product paths."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from kernels._common.prefetch import PREFETCH_ROWS
from kernels.int8 import Int8Linear, _numba_cpu, _vnni, panels, rows
from tests.helpers import planted_int8


@pytest.fixture(params=["loop", "vnni"])
def path(request):
    """The ``path`` argument that selects the portable loop or vpdpbusd (``rows.path_marker``)."""
    if request.param == "vnni" and not _vnni.AVAILABLE:
        pytest.skip(f"Numba's target CPU lacks {', '.join(_vnni.REQUIRED_FEATURES)}: only the loop can run here")
    return rows.path_marker(request.param == "vnni")


@pytest.mark.parametrize("n, k", [(1, 1), (15, 3), (16, 4), (17, 5), (40, 23), (33, 130), (64, 576)])
def test_the_packed_weight_holds_each_byte_where_the_layout_says(rng, n, k):
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    packed = panels.pack(w)
    assert packed.shape == panels.panel_shape(n, k) == (-(-n // 16) * 16, -(-k // 4) * 4)
    flat = packed.reshape(-1)
    Kp = packed.shape[1]
    for row in range(packed.shape[0]):
        for col in range(Kp):
            p, j, q, r = row // 16, row % 16, col // 4, col % 4  # w[16p + j, 4q + r]
            expected = w[row, col] if row < n and col < k else 0  # zeros past N and K
            assert flat[p * 16 * Kp + q * 64 + j * 4 + r] == expected
    assert np.array_equal(panels.unpack(packed, n, k), w)


@njit
def _panel_tasks(path, x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, row_sums, y, n0, n1, shift, ahead, step):
    """Outputs n0 .. n1 − 1 in tasks of ``step`` outputs, as the decode step's threads take them."""
    for t0 in range(n0, n1, step):
        panels.int8_panel_rows(path, x_u8, J, cols, x_o, absmax_x, w_p, absmax_w, row_sums, y, t0,
                               min(t0 + step, n1), shift, ahead)


def _prepared(x, threshold):
    K = x.shape[1]
    buffers = (np.empty(K, np.bool_), np.empty(K, np.int64), np.empty((1, K), np.float32),
               np.empty((1, rows.padded_k(K)), np.uint8), np.empty(1, np.float32))
    J = rows.prepare(x, np.float32(threshold), *buffers)
    flags, cols, x_o, x_u8, absmax_x = buffers
    return J, flags, cols, x_o, x_u8, absmax_x


# K below, at and across the 64-byte vector and the four groups of a step, not a multiple of 4; N below one panel,
# not a multiple of 16, many panels; with and without outlier features, and with enough of them that every byte of a
# group's lanes holds one (c % 4) and the last, partial group of k holds one
@pytest.mark.parametrize("k, n, n_out", [(1, 1, 0), (3, 17, 1), (63, 3, 2), (64, 16, 0), (130, 37, 1),
                                         (577, 70, 3), (1536, 130, 5), (259, 40, 200)])
@pytest.mark.parametrize("ahead", [0, PREFETCH_ROWS])  # the prefetch off (AMD) and on (it changes no value)
@pytest.mark.parametrize("step", [16, 32, 10 ** 6])  # tasks of one panel, of two, the whole range at once
def test_panel_rows_equal_the_blocked_gemv_bit_for_bit(rng, path, k, n, n_out, ahead, step):
    x, w, _ = planted_int8(rng, 1, k, n, n_out)
    weight = Int8Linear.from_float(w).weight
    J, flags, cols, x_o, x_u8, absmax_x = _prepared(x, 6.0)
    assert J == n_out and (n_out < 200 or (set(cols[:J] % 4) == {0, 1, 2, 3} and cols[:J].max() >= k - k % 4))
    expected, expected_flags = np.empty((1, n), np.float32), np.empty(k, np.bool_)
    _numba_cpu.split_gemv(x, np.float32(6.0), weight.w_i8, weight.absmax, expected, expected_flags)
    stored = rng.standard_normal(n + 16).astype(np.float32)  # y and 16 values after it, which nothing may write
    after = stored[n:].copy()
    _panel_tasks(path, x_u8, J, cols, x_o, absmax_x, panels.pack(weight.w_i8), weight.absmax, weight.w_row_sums,
                 stored[:n], 0, n, 0, ahead, step)
    assert np.array_equal(stored[:n].view(np.uint32), expected[0].view(np.uint32))
    assert np.array_equal(stored[n:], after) and np.array_equal(flags, expected_flags)


@pytest.mark.parametrize("half", [16, 20, 40, 1])  # gate and up halves of whole panels, of partial ones
@pytest.mark.parametrize("k, n_out", [(5, 0), (70, 2)])
@pytest.mark.parametrize("step", [16, 32])
def test_a_second_half_packed_on_its_own_is_read_through_the_shift(rng, path, half, k, n_out, step):
    # the decode step packs w_gate_up's gate and up rows apart: the up outputs half .. 2·half − 1 lie in the
    # packed array's rows from its middle on (a shift of Np/2 − half)
    x, w, _ = planted_int8(rng, 1, k, 2 * half, n_out)
    weight = Int8Linear.from_float(w).weight
    J, _, cols, x_o, x_u8, absmax_x = _prepared(x, 6.0)
    assert J == n_out
    expected = np.empty((1, 2 * half), np.float32)
    _numba_cpu.split_gemv(x, np.float32(6.0), weight.w_i8, weight.absmax, expected, np.empty(k, np.bool_))
    packed = np.concatenate([panels.pack(weight.w_i8[:half]), panels.pack(weight.w_i8[half:])])
    y = np.full(2 * half, np.nan, np.float32)
    args = (path, x_u8, J, cols, x_o, absmax_x, packed, weight.absmax, weight.w_row_sums, y)
    _panel_tasks(*args, 0, half, 0, 0, step)
    _panel_tasks(*args, half, 2 * half, packed.shape[0] // 2 - half, 0, step)
    assert np.array_equal(y, expected[0])


@pytest.mark.parametrize("n0, n1", [(16, 48), (32, 37), (64, 70)])  # whole panels; a partial one; the last
def test_a_range_of_outputs_writes_those_outputs_only(rng, path, n0, n1):
    k, n = 130, 70
    x, w, _ = planted_int8(rng, 1, k, n, 3)
    weight = Int8Linear.from_float(w).weight
    J, _, cols, x_o, x_u8, absmax_x = _prepared(x, 6.0)
    expected = np.empty((1, n), np.float32)
    _numba_cpu.split_gemv(x, np.float32(6.0), weight.w_i8, weight.absmax, expected, np.empty(k, np.bool_))
    stored = rng.standard_normal(n + 16).astype(np.float32)
    before = stored.copy()
    _panel_tasks(path, x_u8, J, cols, x_o, absmax_x, panels.pack(weight.w_i8), weight.absmax, weight.w_row_sums,
                 stored[:n], n0, n1, 0, 0, 16)
    assert np.array_equal(stored[n0:n1], expected[0, n0:n1])
    assert np.array_equal(np.delete(stored, np.s_[n0:n1]), np.delete(before, np.s_[n0:n1]))
