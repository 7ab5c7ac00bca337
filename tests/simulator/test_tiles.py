"""The tile simulator: its counted bytes equal the cost model's exactly, its outputs equal the oracles."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kernels.attn import reference
from simulator import costs, tiles
from simulator.costs.tiling import flash_tiles


def _ledger(mapping):
    return {tensor: int(nbytes) for tensor, nbytes in mapping.items() if int(nbytes)}


def assert_same_bytes(cost, machine):
    assert _ledger(cost.reads) == _ledger(machine.reads)
    assert _ledger(cost.writes) == _ledger(machine.writes)
    assert int(cost.flops) == machine.flops
    assert machine.sram_peak_bytes <= int(cost.sram_peak_bytes)


ALGORITHMS = {
    "standard": (tiles.standard_forward, costs.standard_forward),
    "flash1": (tiles.flash1_forward, costs.flash1_forward),
    "flash2": (tiles.flash2_forward, costs.flash2_forward),
}
# (Nq, Nk) x d x SRAM bytes (None: explicit tiles) x (Br, Bc) x causal x (Hq, Hkv)
GRID = list(itertools.product(
    [(1, 1), (17, 17), (40, 29), (29, 64), (1, 70)], [8, 20], [None, 6000],
    [(4, 8), (7, 5), (16, 16)], [False, True], [(2, 2), (4, 2), (3, 1)]))


def _case_id(case):
    (nq, nk), d, sram, (br, bc), causal, (hq, hkv) = case
    tiles_id = f"M{sram}" if sram else f"{br}x{bc}"
    return f"{nq}x{nk}-d{d}-{tiles_id}-{'causal' if causal else 'full'}-H{hq}/{hkv}"


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_simulated_bytes_equal_the_cost_model(rng, algorithm, case):
    (nq, nk), d, sram, (br, bc), causal, (hq, hkv) = case
    if sram is not None:
        br, bc = (int(x) for x in flash_tiles(d, 2, sram, hq // hkv))
    sram_bytes = sram or 10**7
    simulate, model = ALGORITHMS[algorithm]
    q = rng.standard_normal((1, hq, nq, d))
    k, v = (rng.standard_normal((1, hkv, nk, d)) for _ in range(2))
    extra = {"separate_mask": True} if algorithm == "standard" else {}
    result = simulate(q, k, v, causal=causal, Br=br, Bc=bc, sram_bytes=sram_bytes, **extra)
    cost = model(1, hq, hkv, nq, nk, d, causal=causal, Br=br, Bc=bc, sram_bytes=sram_bytes, **extra)
    assert_same_bytes(cost, result.machine)
    np.testing.assert_allclose(result.output, reference(q, k, v, causal=causal), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("sram_bytes", [10**6, 200])
def test_standard_softmax_streams_rows_that_do_not_fit(rng, sram_bytes):
    # 200 bytes hold no 70-score float32 row (280 B): the softmax reads S twice (online max/sum, then normalize)
    q, k, v = rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 70, 4)), rng.standard_normal((1, 1, 70, 4))
    result = tiles.standard_forward(q, k, v, Br=2, Bc=8, sram_bytes=sram_bytes, causal=True)
    cost = costs.standard_forward(1, 1, 1, 5, 70, 4, Br=2, Bc=8, sram_bytes=sram_bytes, causal=True)
    assert_same_bytes(cost, result.machine)
    s_bytes = 5 * 70 * 2
    assert result.machine.reads["S"] == (s_bytes if sram_bytes == 10**6 else 2 * s_bytes)
    np.testing.assert_allclose(result.output, reference(q, k, v, causal=True), atol=1e-12)


@pytest.mark.parametrize("capacity", [None, 24])
def test_decode_against_full_and_pruned_cache(rng, capacity):
    n, hq, hkv, d = 100, 6, 2, 16
    q = rng.standard_normal((1, hq, 1, d))
    k, v = (rng.standard_normal((1, hkv, n, d)) for _ in range(2))
    kept = None
    if capacity:
        kept = np.sort(np.stack([rng.choice(n, capacity, replace=False) for _ in range(hkv)]))[None]
    result = tiles.decode(q, k, v, kept=kept, Bc=16, sram_bytes=10**6)
    cost = costs.decode(1, hq, hkv, n, d, capacity=capacity, Bc=16)
    assert_same_bytes(cost, result.machine)
    if kept is not None:
        k = np.take_along_axis(k, kept[..., None], axis=2)
        v = np.take_along_axis(v, kept[..., None], axis=2)
    np.testing.assert_allclose(result.output, reference(q, k, v, causal=True), atol=1e-12)


def _int8_oracle(x, weights, threshold):
    """LLM.int8() in exact arithmetic: integer products in int64, the outlier part in float64."""
    outliers = np.flatnonzero((np.abs(x) >= threshold).any(axis=0))
    regular = np.setdiff1d(np.arange(x.shape[1]), outliers)
    xr = x[:, regular]
    absmax = np.abs(xr).max(axis=1)
    x_i8 = np.rint(127 * xr / np.where(absmax > 0, absmax, 1)[:, None]).astype(np.int64)
    c = x_i8 @ weights.w_i8[:, regular].T.astype(np.int64)  # (m, n)
    y = c * np.outer(absmax, weights.absmax) / 127**2
    return y + x[:, outliers] @ (weights.w_i8[:, outliers].T * weights.absmax / 127)


@pytest.mark.parametrize("m, k, n, outlier_cols", [(1, 300, 200, []), (1, 257, 130, [5]),
                                                    (150, 70, 260, [3, 17]), (5, 40, 30, [0, 39])])
def test_int8_split_bytes_and_output(rng, m, k, n, outlier_cols):
    x = rng.standard_normal((m, k))
    x[:, outlier_cols] *= 20  # |x| >= 6 somewhere in those columns
    x[0, outlier_cols] = 7.0
    weights = tiles.quantize_weight(rng.standard_normal((n, k)))  # (out, in)
    result = tiles.int8_split(x, weights, threshold=6.0, sram_bytes=10**6)
    assert list(result.outlier_cols) == sorted(set(outlier_cols) | set(np.flatnonzero((np.abs(x) >= 6).any(0))))
    cost = costs.int8_split(m, k, n, result.outlier_cols.size, reuse="tiled")
    assert_same_bytes(cost, result.machine)
    np.testing.assert_allclose(result.output, _int8_oracle(x, weights, 6.0), rtol=1e-12, atol=1e-12)
    # and the algorithm approximates the float product
    exact = x @ (weights.w_i8.T * weights.absmax / 127)
    assert np.abs(result.output - exact).max() <= 0.05 * np.abs(exact).max()


def test_overflowing_the_sram_is_refused(rng):
    q, k, v = (rng.standard_normal((1, 1, 64, 32)) for _ in range(3))
    br, bc = 64, 64
    needed = int(costs.flash_sram_bytes(br, bc, 32, 2))
    tiles.flash2_forward(q, k, v, Br=br, Bc=bc, sram_bytes=needed)
    with pytest.raises(tiles.SramOverflowError, match="over the"):
        tiles.flash2_forward(q, k, v, Br=br, Bc=bc, sram_bytes=needed - 1)


def test_timeline_records_every_transfer(rng):
    q, k, v = (rng.standard_normal((1, 2, 20, 8)) for _ in range(3))
    result = tiles.flash2_forward(q, k, v, causal=True, Br=8, Bc=8, sram_bytes=10**6)
    events = result.machine.timeline
    loads = sum(ev.nbytes for ev in events if ev.op == "load")
    stores = sum(ev.nbytes for ev in events if ev.op == "store")
    assert loads == result.machine.hbm_read_bytes and stores == result.machine.hbm_write_bytes
    assert sum(ev.flops for ev in events if ev.op == "compute") == result.machine.flops
    assert max(ev.sram_used for ev in events) == result.machine.sram_peak_bytes


def test_the_simulator_refuses_what_the_cost_model_refuses(rng):
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    with pytest.raises(ValueError, match="Br must be >= 1"):  # ran no tile and counted no byte before
        tiles.flash2_forward(q, k, v, Br=-4, Bc=8, sram_bytes=2**16)
    with pytest.raises(ValueError, match="sram_bytes must be >= 1"):
        tiles.flash1_forward(q, k, v, Br=4, Bc=8, sram_bytes=0)
    with pytest.raises(ValueError, match="4-D array"):
        tiles.standard_forward(q[0], k, v, Br=4, Bc=8, sram_bytes=2**16)
    x = rng.standard_normal((3, 32))
    weight = tiles.quantize_weight(rng.standard_normal((5, 40)))  # K = 40 against x's 32
    with pytest.raises(ValueError, match="weights must be \\(n, k\\)"):
        tiles.int8_split(x, weight, sram_bytes=2**16)


@pytest.mark.parametrize("algorithm", ["flash2_forward", "flash1_forward", "standard_forward"])
def test_the_simulator_refuses_values_it_would_not_follow(rng, algorithm):
    # a NaN row came back as zeros with lse −inf (the schedules read −inf as "no key seen"), an inf in K gave
    # finite values from flash1; complex input was made real with a warning
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    run = getattr(tiles, algorithm)
    for name, value in (("q", np.nan), ("k", np.inf), ("v", -np.inf)):
        bad = {"q": q, "k": k, "v": v}
        bad[name] = bad[name].copy()
        bad[name][0, 1, 3, 2] = value
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            run(bad["q"], bad["k"], bad["v"], Br=4, Bc=8, sram_bytes=2**16)
    with pytest.raises(TypeError, match="q must be a real numpy.ndarray"):
        run(q.astype(complex), k, v, Br=4, Bc=8, sram_bytes=2**16)
    with pytest.raises(TypeError, match="k must be a real numpy.ndarray"):
        run(q, k.tolist(), v, Br=4, Bc=8, sram_bytes=2**16)
    for scale in (np.nan, np.inf, "0.1"):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            run(q, k, v, Br=4, Bc=8, sram_bytes=2**16, scale=scale)
    out = run(q, k, v, Br=4, Bc=8, sram_bytes=2**16, scale=np.float32(0.5)).output
    from kernels.attn import reference

    np.testing.assert_allclose(out, reference(q, k, v, scale=0.5), rtol=1e-10, atol=1e-12)
