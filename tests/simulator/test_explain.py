"""``ioaware explain``: every number the lessons promise, from the kernels, the cost model and the tile simulator.

The model-based topics run on the tiny random-weight SmolLM2 of tests/models/test_tiny_model.py (no download)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from models.passkey import make_case
from models.smollm2 import SmolLM2
from simulator import costs
from simulator.cli import main
from simulator.hardware import load
from simulator.explain import TOPICS, kv_cache, outliers, run_topic, snapkv, softmax_tiles, topic_module
from simulator.explain import flash_tiles, transformer
from tests.models.test_tiny_model import TINY, tiny_weights


def softmax(s):
    e = np.exp(np.asarray(s, dtype=np.float64) - np.max(s))
    return e / e.sum()


@pytest.fixture
def tiny_model(rng):
    model = SmolLM2(weights=tiny_weights(rng))
    model.encode = lambda text: [b % TINY.vocab for b in text.encode()]  # no tokenizer in the tiny model
    return model


# --- softmax-tiles -------------------------------------------------------------------------------------------

def test_full_softmax_and_the_200_percent_of_per_tile_softmax():
    full, lse = softmax_tiles.softmax_by_attention(softmax_tiles.SCORES)
    np.testing.assert_allclose(full, [0.002, 0.047, 0.001, 0.950], atol=6e-4)  # the rounded values
    np.testing.assert_allclose(full, softmax(softmax_tiles.SCORES), atol=1e-15)
    assert full.sum() == pytest.approx(1.0, abs=1e-15)
    assert lse == pytest.approx(math.log(np.exp(softmax_tiles.SCORES).sum()), abs=1e-12)
    s, t = np.array(softmax_tiles.SCORES), softmax_tiles.TILE
    naive = np.concatenate([softmax_tiles.softmax_by_attention(s[i:i + t])[0] for i in range(0, s.size, t)])
    assert naive.sum() == pytest.approx(2.0, abs=1e-14)


@pytest.mark.parametrize("n, tile", [(4, 2), (13, 4), (13, 1), (7, 7), (5, 9), (64, 16)])
def test_online_softmax_equals_the_full_softmax(rng, n, tile):
    s = rng.standard_normal(n) * 4
    v = rng.standard_normal((n, 3))
    o, steps = softmax_tiles.online_softmax(s, v, tile)
    np.testing.assert_allclose(o, softmax(s) @ v, atol=1e-13)
    assert len(steps) == math.ceil(n / tile)
    assert steps[-1]["m_new"] == s.max()
    assert steps[-1]["m_new"] + math.log(steps[-1]["l_new"]) == pytest.approx(np.log(np.exp(s).sum()), abs=1e-12)
    for before, after in zip(steps, steps[1:]):
        assert after["correction"] == pytest.approx(math.exp(before["m_new"] - after["m_new"]), abs=0)


def test_softmax_lesson_states_the_computed_numbers():
    lesson = run_topic("softmax-tiles", n=20, tile=6)
    text = lesson.markdown
    assert "sums to **2.000**" in text and "200% attention" in text
    _, steps = softmax_tiles.online_softmax(softmax_tiles.SCORES, np.eye(4), 2)
    assert f"{steps[1]['correction']:.4g}" in text  # exp(5 − 8), the correction of the second tile
    assert "sums to 4.000 over its 4 tiles" in text  # N = 20 in key tiles of 6


# --- flash-tiles ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tiles", [1, 2, 3])
def test_replay_has_one_frame_per_step_and_ends_at_the_cost_model(n_tiles):
    results, _, _ = flash_tiles.simulate(seed=1, n_tiles=n_tiles)
    n = n_tiles * flash_tiles.BLOCK
    expected_steps = {"standard": 2 * n_tiles * n_tiles + n, "flash1": 1 + n_tiles * n_tiles,
                      "flash2": n_tiles * n_tiles}  # qk and pv per tile pair plus a softmax per row; init + pairs
    for name, (result, cost) in results.items():
        timeline = result.machine.timeline
        grouped = flash_tiles.steps(timeline)
        assert sum(map(len, grouped)) == len(timeline)
        frames = flash_tiles.frames(timeline, flash_tiles.BLOCK)
        assert len(frames) == len(grouped) == expected_steps[name]
        moved = {t: int(cost.reads.get(t, 0)) + int(cost.writes.get(t, 0)) for t in set(cost.reads) | set(cost.writes)}
        assert frames[-1].moved == {t: b for t, b in moved.items() if b}
        assert all(ev.rows is not None for ev in timeline if ev.op in ("load", "store"))


def test_flash2_frames_hold_the_tiles_of_algorithm_1():
    results, _, _ = flash_tiles.simulate(seed=2, n_tiles=3)
    frames = flash_tiles.frames(results["flash2"][0].machine.timeline, flash_tiles.BLOCK)
    for step, frame in enumerate(frames):
        i, j = divmod(step, 3)  # outer loop over query blocks, inner over K/V tiles
        assert frame.on_chip["Q"] == {(i, 0)} and frame.on_chip["K"] == {(j, 0)} and frame.on_chip["S"] == {(i, j)}
        assert ("K", j, 0) in frame.loaded and ("V", j, 0) in frame.loaded
        assert (("O", i, 0) in frame.stored) == (j == 2)  # O_i is written once, after its last K/V tile


def test_gif_frames_equal_the_simulator_steps(tmp_path):
    from PIL import Image

    lesson = run_topic("flash-tiles", out=tmp_path, tile=2)
    results, _, _ = flash_tiles.simulate(seed=0, n_tiles=2)
    for name, (result, _) in results.items():
        with Image.open(tmp_path / f"flash_tiles_{name}.gif") as gif:
            assert gif.n_frames == len(flash_tiles.steps(result.machine.timeline))
    assert "**no**" not in lesson.markdown  # every simulated byte count equals the cost model's


# --- outliers ------------------------------------------------------------------------------------------------

def test_one_absmax_scale_crushes_the_small_values():
    step, rows = outliers.quantize_table(outliers.X)
    assert step == pytest.approx(100 / 127, rel=1e-7) and f"{step:.3f}" == "0.787"
    assert [q for _, _, q, _, _ in rows] == [0, 1, 1, 0, 127]
    step4, rows4 = outliers.quantize_table(outliers.X[:-1])
    assert step4 == pytest.approx(0.91 / 127, rel=1e-6)
    assert max(abs(e) for *_, e in rows4) <= step4 / 2 + 1e-7


def test_the_split_is_its_two_parts_and_beats_one_scale(rng):
    w = rng.standard_normal((5, 4)).astype(np.float32)
    y, out = outliers.split_products(outliers.X, w)
    assert list(out) == [4]
    np.testing.assert_allclose(y["int8 part"] + y["float16 part"], y["LLM.int8()"], rtol=1e-6, atol=1e-5)
    err = {k: np.abs(y[k] - y["exact"]).mean() for k in ("naive", "LLM.int8()")}
    assert err["LLM.int8()"] < err["naive"] / 5


def test_outliers_of_the_tiny_model(tiny_model):
    lesson = run_topic("outliers", model=tiny_model, context=24)
    counts, dims = outliers.smollm2_outliers(tiny_model, list(range(24)))
    assert set(dims) == {"wqkv", "wo", "w_gate_up", "w_down"} and len(counts) == 4 * TINY.n_layers
    assert "0.7874" in lesson.markdown and "Skipped" not in lesson.markdown


@pytest.mark.parametrize("topic, module", [("outliers", outliers), ("snapkv", snapkv)])
def test_model_topics_skip_with_the_reason(monkeypatch, topic, module):
    monkeypatch.setattr(module, "load_smollm2", lambda: (None, "needs the model extra (test)"))
    assert "*Skipped: needs the model extra (test)*" in run_topic(topic).markdown


# --- snapkv --------------------------------------------------------------------------------------------------

def test_snapkv_views_on_the_tiny_model(tiny_model):
    case = make_case(tiny_model.encode, 600, 0.5, seed=3)
    seen = snapkv.observe(tiny_model, case, capacity=64)
    hkv = TINY.n_kv_heads
    assert seen["votes"].shape == (hkv, 600 - snapkv.WINDOW)
    for name in snapkv.POLICIES:
        assert seen["kept"][name].shape == (hkv, 64)
    np.testing.assert_array_equal(seen["kept"]["streaming"][0], np.r_[0:4, 600 - 60:600])
    assert all(np.isin(np.arange(600 - snapkv.WINDOW, 600), row).all() for row in seen["kept"]["snapkv"])
    assert set(seen["answers"]) == {"full", *snapkv.POLICIES}
    kept = snapkv.needle_kept(seen["kept"]["streaming"], case)
    assert kept == [0] * hkv  # the needle at depth 0.5 is neither a sink nor recent


# --- kv-cache ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("capacity", [None, 512])
def test_decode_step_reads_the_cache_and_the_weights(capacity):
    from models import get_config, kv_cache_bytes

    cfg = get_config("llama-3.1-8b")
    hw = load("H100-SXM")
    step = kv_cache.decode_step(cfg, hw, 8192, capacity)
    cache = kv_cache_bytes(cfg, capacity or 8192)
    activations = cfg.n_layers * cfg.n_heads * cfg.head_dim * 2 * 2  # q read and o written, fp16
    lse = cfg.n_layers * cfg.n_heads * 4
    assert step["kv"][0] == cache + activations + lse
    matrices = 2 * (cfg.n_layers * sum(i * o for i, o in cfg.linear_shapes()) + cfg.hidden * cfg.vocab)
    assert 0 < step["weights"][0] - matrices < 1e-3 * matrices  # plus each GEMV's input and output vectors
    assert step["weights"][1] >= step["weights"][0] / hw.hbm_bandwidth


def test_kv_cache_kinds():
    from models import PRESETS

    assert kv_cache.attention_kind(PRESETS["llama-2-7b"]) == "MHA"
    assert kv_cache.attention_kind(PRESETS["llama-3.1-8b"]).startswith("GQA (4")


# --- transformer ---------------------------------------------------------------------------------------------

def test_transformer_lesson_checks_against_the_reference():
    trace, logits, ref, _ = transformer.run_small(seed=5)
    np.testing.assert_allclose(logits, ref, atol=1e-5 * np.abs(ref).max())
    assert ("decoder cross-attention (Nq ≠ Nk): Q = x W_Q, split into heads", (2, 4, 7, 8)) in trace
    assert ("decoder cross-attention (Nq ≠ Nk): K = x W_K, V = x W_V, split into heads", (2, 4, 9, 8)) in trace


def test_transformer_components_sum_to_the_cost_model():
    from models.transformer import BASE

    sram = load("H100-SXM").sram_per_sm_bytes
    parts = transformer.component_costs(BASE, 256, 128, sram_bytes=sram)
    assert len(parts["attention core"]) == 3 * BASE.n_layers and len(parts["projections"]) == 12 * BASE.n_layers
    assert len(parts["FFN"]) == 2 * 2 * BASE.n_layers
    cross = parts["attention core"][BASE.n_layers + 1]
    assert int(cross.flops) == int(costs.flash2_forward(1, 8, 8, 128, 256, 64, sram_bytes=sram).flops)
    totals = transformer.totals(parts)
    assert totals["FFN"][1] == 2 * 2 * BASE.n_layers * (256 + 128) * BASE.d_model * BASE.d_ff


# --- the command and its files -------------------------------------------------------------------------------

def test_the_command_lists_the_topics(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in TOPICS)


def test_the_command_prints_plain_text_when_piped(capsys):
    assert main(["explain", "kv-cache", "--context", "4096", "--capacity", "256"]) == 0
    out = capsys.readouterr().out
    assert "| llama-3.1-8b |" in out and "\x1b[" not in out


def test_the_command_never_writes_over_a_directory(tmp_path, capsys, monkeypatch):
    # as the report: an existing --out (an example report's, say) and "" (the current directory) were written into
    (tmp_path / "index.md").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for out in (str(tmp_path), "", "  "):
        assert main(["explain", "kv-cache", "--out", out]) == 2
        assert "--out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.md"] and (tmp_path / "index.md").read_text() == "mine"
    assert main(["explain", "kv-cache", "--out", "page"]) == 0
    assert (tmp_path / "page" / "index.html").is_file()
    assert main(["explain", "kv-cache", "--context", "2048", "--capacity", "100000", "--out", "refused"]) == 2
    assert "capacity must be below the context (2,048 tokens)" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()  # (left behind, it refused the rerun with a valid capacity)
    with pytest.raises(SystemExit):  # a negative seed, before anything runs
        main(["explain", "softmax-tiles", "--seed", "-1"])
    assert "--seed: must be >= 0" in capsys.readouterr().err


OPTIONS = {"softmax-tiles": {"n": 16, "tile": 4}, "flash-tiles": {"tile": 2}, "outliers": {"context": 16},
           "snapkv": {"context": 600, "capacity": 64}, "kv-cache": {}, "transformer": {"n": 256}}


@pytest.mark.parametrize("topic", list(TOPICS))
def test_out_writes_every_file_index_html_references(tmp_path, tiny_model, topic):
    model = {"model": tiny_model} if "model" in topic_module(topic).OPTIONS else {}
    lesson = run_topic(topic, out=tmp_path, **OPTIONS[topic], **model)
    html = (tmp_path / "index.html").read_text()
    referenced = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert referenced and sorted(referenced) == sorted(lesson.files)
    assert all((tmp_path / name).stat().st_size > 0 for name in referenced)
    assert (tmp_path / "index.md").read_text() == lesson.markdown
