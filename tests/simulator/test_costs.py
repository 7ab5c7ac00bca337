"""The analytic cost model: scaling laws, lower bounds, FLOP counts, vectorized sweeps and the roofline."""
from __future__ import annotations

import numpy as np
import pytest

from simulator import costs, hardware
from simulator.costs.tiling import causal_tile_sums, floor_sum, visible_pairs

E = 2  # fp16


def test_floor_sum_matches_the_loop(rng):
    n, m, a, b = (rng.integers(lo, hi, 500) for lo, hi in ((0, 40), (1, 25), (0, 60), (0, 80)))
    expected = [sum((ai * i + bi) // mi for i in range(ni)) for ni, mi, ai, bi in zip(n, m, a, b)]
    assert np.array_equal(floor_sum(n, m, a, b), expected)


def test_tile_sums_match_enumeration(rng):
    for _ in range(400):
        nq, nk, br, bc = (int(x) for x in rng.integers(1, 70, 4))
        causal = bool(rng.integers(2))
        sums = [0, 0, 0, 0]
        for r0 in range(0, nq, br):
            rows = min(br, nq - r0)
            kend = nk if not causal else max(0, min(nk, r0 + rows + nk - nq))
            t = -(-kend // bc)
            keys = min(t * bc, nk)
            for idx, value in enumerate((t, keys, rows * keys, rows * t)):
                sums[idx] += value
        assert [int(x) for x in causal_tile_sums(nq, nk, br, bc, causal)[1:]] == sums
        pairs = sum(max(0, min(nk, i + nk - nq + 1)) for i in range(nq)) if causal else nq * nk
        assert visible_pairs(nq, nk, causal) == pairs


def test_standard_n_squared_term_quadruples_with_n():
    one, two = (costs.standard_forward(1, 8, 8, n, n, 64, Br=64, Bc=64, sram_bytes=2**20) for n in (1024, 2048))
    for tensor in ("S", "P"):
        assert two.writes[tensor] == 4 * one.writes[tensor]
        assert two.reads[tensor] == 4 * one.reads[tensor]


def test_doubling_sram_halves_flash1_rereads():
    # d = 64, fp16: M = 64 KiB gives (Br, Bc) = (32, 128), M = 128 KiB gives (32, 256) (the rule, then shrunk to fit)
    small, big = (costs.flash1_forward(1, 8, 8, 4096, 4096, 64, sram_bytes=m) for m in (64 * 2**10, 128 * 2**10))
    assert (small.params["Bc"], big.params["Bc"]) == (128, 256)
    assert small.reads["Q"] == 2 * big.reads["Q"]
    assert small.reads["O"] == 2 * big.reads["O"]
    assert small.reads["K"] == big.reads["K"]  # read once either way


def test_doubling_the_query_block_halves_flash2_rereads():
    a, b = (costs.flash2_forward(2, 8, 2, 4096, 4096, 64, Br=br, Bc=128) for br in (64, 128))
    assert a.reads["K"] == 2 * b.reads["K"] and a.reads["V"] == 2 * b.reads["V"]


GRID = [(b, hq, hkv, nq, nk, d, causal) for b, hq, hkv in ((1, 4, 4), (2, 9, 3), (1, 8, 1))
        for nq, nk in ((1, 4096), (1000, 1000), (3000, 4100), (4100, 3000)) for d in (64, 128)
        for causal in (False, True)]


@pytest.mark.parametrize("algorithm", [costs.standard_forward, costs.flash1_forward, costs.flash2_forward])
@pytest.mark.parametrize("hw_name", ["A100-40GB-SXM", "T4"])
def test_no_algorithm_moves_less_than_its_inputs_and_output(algorithm, hw_name):
    sram = hardware.load(hw_name).sram_per_sm_bytes
    for b, hq, hkv, nq, nk, d, causal in GRID:
        c = algorithm(b, hq, hkv, nq, nk, d, causal=causal, sram_bytes=sram)
        q_bytes, kv_bytes = b * hq * nq * d * E, b * hkv * nk * d * E
        assert c.reads["Q"] >= q_bytes and c.reads["K"] >= kv_bytes and c.reads["V"] >= kv_bytes
        assert c.writes["O"] >= q_bytes
        assert c.sram_peak_bytes <= sram


def test_flops_count_four_n_squared_d_per_head():
    n, d, h = 2048, 64, 12
    full = costs.flash2_forward(1, h, h, n, n, d, Br=64, Bc=64)
    assert full.useful_flops == full.flops == 4 * n * n * d * h
    causal = costs.flash2_forward(1, h, h, n, n, d, causal=True, Br=64, Bc=64)
    assert causal.useful_flops == 4 * d * h * n * (n + 1) // 2  # half, plus the diagonal
    # tiles on the diagonal are computed whole: 32 diagonal 64x64 tiles of which half is masked
    assert causal.flops == causal.useful_flops + 4 * d * h * (n // 64) * (64 * 63 // 2)
    assert costs.standard_forward(1, h, h, n, n, d, causal=True, Br=64, Bc=64).flops == 4 * n * n * d * h


def test_backward_recomputes_instead_of_reading_p():
    std = costs.standard_backward(1, 8, 8, 4096, 4096, 64)
    fl = costs.flash2_backward(1, 8, 8, 4096, 4096, 64, Br=64, Bc=128)
    assert std.reads["P"] == 2 * 8 * 4096 * 4096 * E and "P" not in fl.reads
    assert fl.hbm_bytes < std.hbm_bytes / 2
    assert fl.flops == 10 * 4096 * 4096 * 64 * 8 and std.useful_flops == fl.useful_flops


def test_decode_reads_the_kept_cache_once():
    full = costs.decode(1, 9, 3, 16384, 64, Bc=128)
    pruned = costs.decode(1, 9, 3, 16384, 64, capacity=1024, Bc=128)
    assert full.reads["K"] == 3 * 16384 * 64 * E and pruned.reads["K"] == 3 * 1024 * 64 * E


def test_int8_split_moves_a_quarter_of_the_fp32_weight():
    dense32 = costs.dense(1, 4096, 4096, elem_bytes=4, flop_kind="fp32")
    split = costs.int8_split(1, 4096, 4096, 0)
    assert split.dram_reads["W_i8"] * 4 == dense32.dram_reads["W"]
    with_outliers = costs.int8_split(1, 4096, 4096, 8)
    assert with_outliers.reads["W_i8"] == split.reads["W_i8"]  # the same rows, split in two GEMMs
    assert with_outliers.flops == split.flops


def test_arrays_sweep_like_scalars():
    n = np.array([512, 1000, 4096, 7777])
    d = np.array([64, 128, 64, 80])
    swept = costs.flash2_forward(1, 8, 2, n, n, d, causal=True, sram_bytes=164 * 2**10)
    for i in range(n.size):
        one = costs.flash2_forward(1, 8, 2, int(n[i]), int(n[i]), int(d[i]), causal=True, sram_bytes=164 * 2**10)
        assert swept.hbm_read_bytes[i] == one.hbm_read_bytes and swept.flops[i] == one.flops


def test_roofline_time_names_the_bound():
    hw = hardware.load("A100-40GB-SXM")
    std = costs.standard_forward(1, 16, 16, 8192, 8192, 64, sram_bytes=hw.sram_per_sm_bytes).time(hw)
    assert all(k.bound == "dram" for k in std.kernels)
    gemm = costs.dense(8192, 8192, 8192)
    timing = gemm.time(hw)
    assert timing.kernels[0].bound == "compute"
    assert timing.seconds == pytest.approx(2 * 8192**3 / 312e12 + 5e-6)
    # the same GEMM with every tile from DRAM (no L2 reuse) moves 64x the bytes of X and W
    tiled = costs.dense(8192, 8192, 8192, reuse="tiled")
    assert tiled.dram_reads["X"] == 64 * gemm.dram_reads["X"] and tiled.dram_reads["W"] == 64 * gemm.dram_reads["W"]
    assert dict(tiled.reads) == dict(gemm.reads)  # the tile loads are the same either way
    gemv = costs.dense(1, 4096, 4096).time(hw)
    assert gemv.kernels[0].bound == "dram"


def test_a_hand_computed_case():
    # A100 (164 KiB SRAM), fp16, 16 heads, N = 1024, d = 64. Standard: the largest square GEMM tile that fits is
    # 128 (256 needs 2·(256·64 + 256·64 + 256²) = 196,608 B), so K and V are read 1024/128 = 8 times.
    c = costs.standard_forward(1, 16, 16, 1024, 1024, 64, sram_bytes=164 * 1024)
    nn = 16 * 1024 * 1024 * 2  # one S or P, bytes
    qo = 16 * 1024 * 64 * 2
    assert dict(c.writes) == {"S": nn, "P": nn, "O": qo}
    assert dict(c.reads) == {"Q": qo, "K": 8 * qo, "S": nn, "P": nn, "V": 8 * qo}
    assert c.hbm_bytes == 171_966_464
    # FlashAttention-1 by the rule: Bc = ceil(83968 / 256) = 328, Br = min(328, 64) = 64, halved to 32 to fit;
    # Q and O move once per K/V tile (ceil(1024 / 328) = 4 tiles)
    f1 = costs.flash1_forward(1, 16, 16, 1024, 1024, 64, sram_bytes=164 * 1024)
    assert (int(f1.params["Br"]), int(f1.params["Bc"])) == (32, 328)
    assert f1.reads["Q"] == 4 * qo and f1.reads["K"] == qo


BAD_SIZES = [
    ({"Hkv": 0}, ValueError, "Hkv must be >= 1"),
    ({"Hkv": 3}, ValueError, "multiple of Hkv"),
    ({"Nq": 4096.7}, ValueError, "Nq must be a whole number"),
    ({"Nq": -5}, ValueError, "Nq must be >= 1"),
    ({"d": np.array([64, 0])}, ValueError, "d must be >= 1"),
    ({"Nq": 2**40, "Nk": 2**40}, ValueError, "beyond the cost model's 64-bit counts"),  # negative bytes before
    ({"Nk": 10**20}, ValueError, "beyond the cost model's 64-bit counts"),
    ({"B": True}, TypeError, "B must be a whole number"),
    ({"B": "1"}, TypeError, "B must be a whole number"),
]


@pytest.mark.parametrize("bad, exc, pattern", BAD_SIZES, ids=[str(b[0]) for b in BAD_SIZES])
@pytest.mark.parametrize("model", [costs.standard_forward, costs.flash1_forward, costs.flash2_forward,
                                   costs.standard_backward, costs.flash2_backward])
def test_bad_sizes_are_refused_before_anything_is_counted(model, bad, exc, pattern):
    sizes = {"B": 1, "Hq": 16, "Hkv": 4, "Nq": 256, "Nk": 256, "d": 64, **bad}
    tiles = {} if model is costs.standard_backward else {"sram_bytes": 2**17}
    with pytest.raises(exc, match=pattern):
        model(sizes["B"], sizes["Hq"], sizes["Hkv"], sizes["Nq"], sizes["Nk"], sizes["d"], **tiles)


def test_bad_matmul_and_decode_sizes_are_refused():
    with pytest.raises(ValueError, match="n_outliers must be <= k"):
        costs.int8_split(1, 64, 64, 65)
    with pytest.raises(ValueError, match="n_outliers must be >= 0"):
        costs.int8_split(1, 64, 64, -1)
    with pytest.raises(ValueError, match="64-bit counts"):
        costs.dense(2**30, 2**30, 2**30)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        costs.decode(1, 8, 8, 4096, 64, capacity=0, sram_bytes=2**17)
    with pytest.raises(ValueError, match="Bc must be >= 1"):
        costs.flash2_forward(1, 8, 8, 64, 64, 64, Br=16, Bc=-4)


def test_roofline_over_the_levels_names_the_level_that_binds():
    hw = hardware.load("H100-SXM")
    # the paper's Br <= d tiles load K and V 64 times per head: the L2 traffic, not DRAM, binds on an H100
    paper = costs.flash2_forward(1, 16, 16, 4096, 4096, 64, hw=hw).time(hw).kernels[0]
    assert paper.bound == "l2" and paper.l2_s > paper.compute_s > paper.dram_s
    assert paper.seconds == pytest.approx(paper.l2_s + hw.launch_overhead_s)
    # a spec without a sourced L2 bandwidth has no L2 term
    no_l2 = hardware.replace(hw, l2_bandwidth=0.0)
    assert costs.flash2_forward(1, 16, 16, 4096, 4096, 64, hw=no_l2).time(no_l2).kernels[0].l2_s == 0


def test_without_hw_the_ledger_is_the_two_level_one():
    hw = hardware.load("A100-40GB-SXM")
    two = costs.flash2_forward(2, 8, 2, 2048, 2048, 64, sram_bytes=hw.sram_per_sm_bytes)
    three = costs.flash2_forward(2, 8, 2, 2048, 2048, 64, hw=hw)
    assert dict(two.reads) == dict(three.reads) and dict(two.writes) == dict(three.writes)  # same tiles
    assert two.dram_bytes == two.l2_traffic_bytes == two.hbm_bytes
    assert three.dram_bytes < three.l2_traffic_bytes and three.hbm_bytes == three.dram_bytes


@pytest.mark.parametrize("model", [costs.flash2_forward, costs.flash1_forward, costs.standard_forward,
                                   costs.flash2_backward])
def test_a_sweep_through_the_l2_equals_its_configurations_one_by_one(model):
    hw = hardware.load("A100-40GB-SXM")
    n = np.array([256, 1000, 4096, 16384])
    swept = model(1, 8, 2, n, n, 64, causal=True, hw=hw)
    for i in range(n.size):
        one = model(1, 8, 2, int(n[i]), int(n[i]), 64, causal=True, hw=hw)
        assert float(swept.dram_bytes[i]) == pytest.approx(float(one.dram_bytes))
        assert float(swept.time(hw).seconds[i]) == pytest.approx(float(one.time(hw).seconds))


def test_the_shared_cache_never_adds_bytes():
    for name in hardware.preset_names():
        hw = hardware.load(name)
        for causal in (False, True):
            for model in (costs.flash2_forward, costs.flash1_forward, costs.standard_forward, costs.flash2_backward):
                c = model(2, 16, 4, 8192, 8192, 128, causal=causal, hw=hw)
                assert float(c.dram_bytes) <= float(c.l2_traffic_bytes)
                # every input is read once and every output written once at least
                assert float(c.dram_bytes) >= 2 * 16 * 8192 * 128 * 2 * 2


def test_a_bad_tile_or_hardware_is_named():
    # dense(tile=0) was "'int' object is not subscriptable", Cost.time(None) an AttributeError
    from simulator import costs

    for tile, pattern in ((0, "tile must be a"), ((128, 128), "tile must be a"), ((128, 0, 32), "Bn must be >= 1")):
        with pytest.raises(ValueError, match=pattern):
            costs.dense(4, 8, 16, tile=tile)
        with pytest.raises(ValueError, match=pattern):
            costs.int8_split(4, 8, 16, 1, tile=tile)
    with pytest.raises(TypeError, match="hw must be a simulator.hardware.HardwareSpec; got NoneType"):
        costs.dense(4, 8, 16).time(None)
