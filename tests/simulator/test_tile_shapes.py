"""Tile shapes as implemented: the restated values (``simulator.costs.tile_shapes``, which imports no kernels)
equal the kernels' own constants and rules; flash-attn's table follows its launch template; the rule each
``tiles=`` names reaches the cost model."""
from __future__ import annotations

import pytest

from kernels.attn import _blocks, _cupy, _numba_cuda
from simulator import costs, hardware
from simulator.costs import tile_shapes
from simulator.hardware import replace


def test_cpu_kernel_constants_are_restated():
    assert (tile_shapes.CPU_MIN_BLOCK, tile_shapes.CPU_MAX_BLOCK_K) == (_blocks.MIN_BLOCK, _blocks.MAX_BLOCK_K)


@pytest.mark.parametrize("l2", [256 * 1024, 1 << 20, 2 << 20, 32 << 20])
@pytest.mark.parametrize("d, elem_bytes, group", [(64, 4, 1), (128, 4, 4), (80, 2, 3), (8, 8, 1), (256, 4, 8)])
def test_cpu_tiles_equal_the_kernels(monkeypatch, l2, d, elem_bytes, group):
    monkeypatch.setattr(_blocks, "l2_bytes", lambda: l2)
    br, bc, _, _ = tile_shapes.ioaware_cpu_tiles(d, elem_bytes, group, l2)
    assert (br, bc) == _blocks.default_blocks(d, elem_bytes, group)


@pytest.mark.parametrize("d", _cupy.HEAD_DIMS)
def test_cupy_tier_tiles_equal_the_kernels(d):
    br, bc, smem, _ = tile_shapes.ioaware_cupy_tiles(d)
    assert (br, bc) == (_cupy.BR, _cupy.BC)
    assert smem == _cupy.flash_shared_bytes(d)
    assert tile_shapes.CUPY_HEAD_DIMS == _cupy.HEAD_DIMS


@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_numba_cuda_tier_tiles_equal_the_kernels(d, elem_bytes):
    br, bc, smem, _ = tile_shapes.ioaware_numba_cuda_tiles(d, elem_bytes)
    assert (br, bc) == _numba_cuda.default_tiles(d, elem_bytes)
    assert smem == _numba_cuda.flash_shared_bytes(br, bc, d, elem_bytes)


@pytest.mark.parametrize("preset, d, causal, expected", [
    ("A100-40GB-SXM", 64, False, (128, 128)), ("H100-SXM", 64, True, (128, 128)),
    ("A100-40GB-SXM", 128, False, (128, 64)), ("RTX-4090", 128, False, (128, 32)),
    ("RTX-4090", 128, True, (64, 64)), ("L4", 96, True, (64, 64)), ("H100-SXM", 96, False, (128, 64)),
    ("A100-40GB-SXM", 256, False, (128, 64)), ("H100-SXM", 256, False, (64, 64)),
    ("H100-SXM", 40, False, (128, 128)),  # d rounded up to 64
    ("A100-80GB-SXM", 160, False, (128, 64)),  # d rounded up to 192
])
def test_flash_attn_table(preset, d, causal, expected):
    br, bc, smem, threads = tile_shapes.flash_attn_fwd_tiles(d, causal, hardware.load(preset))
    assert (br, bc) == expected
    assert smem <= hardware.load(preset).sram_per_sm_bytes  # a CTA fits an SM
    assert threads in (128, 256)


def test_flash_attn_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match="Ampere"):
        tile_shapes.flash_attn_fwd_tiles(64, False, hardware.load("T4"))
    with pytest.raises(ValueError, match="256"):
        tile_shapes.flash_attn_fwd_tiles(512, False, hardware.load("H100-SXM"))
    with pytest.raises(ValueError, match="fp16"):
        tile_shapes.flash_attn_fwd_tiles(64, False, hardware.load("H100-SXM"), elem_bytes=4)
    with pytest.raises(ValueError, match="hw"):
        costs.flash2_forward(1, 2, 2, 64, 64, 64, sram_bytes=2**16, tiles="ioaware")
    with pytest.raises(ValueError, match="unknown tiles"):
        costs.flash2_forward(1, 2, 2, 64, 64, 64, sram_bytes=2**16, tiles="fast")


def test_the_rule_reaches_the_cost_model(monkeypatch):
    hw = hardware.load("H100-SXM")
    paper = costs.flash2_forward(1, 16, 16, 4096, 4096, 64, hw=hw)
    fa = costs.flash2_forward(1, 16, 16, 4096, 4096, 64, hw=hw, tiles="flash-attn")
    ours = costs.flash2_forward(1, 16, 16, 4096, 4096, 64, hw=hw, tiles="ioaware")
    assert (int(paper.params["Br"]), int(fa.params["Br"]), int(ours.params["Br"])) == (64, 128, 64)
    assert int(paper.params["Br"]) <= 64  # the paper's Br <= d
    # fewer, taller query blocks: half the K/V tile traffic of the paper's rule
    assert fa.l2_traffic_bytes < paper.l2_traffic_bytes
    cpu = replace(hw, kind="cpu", sram_per_sm_bytes=2 << 20, sm_count=2, compute_capability="")
    on_cpu = costs.flash2_forward(1, 4, 4, 1024, 1024, 64, elem_bytes=4, hw=cpu, tiles="ioaware")
    monkeypatch.setattr(_blocks, "l2_bytes", lambda: 2 << 20)  # the kernel on a machine with that core L2
    assert (int(on_cpu.params["Br"]), int(on_cpu.params["Bc"])) == _blocks.default_blocks(64, 4, 1)
