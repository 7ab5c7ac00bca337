"""The encoder-decoder Transformer on kernels.attention against its float64 reference, and its masks."""
from __future__ import annotations

import numpy as np
import pytest

from models.transformer import (Transformer, TransformerConfig, random_weights, reference,
                                sinusoidal_encoding)

# float32 through embeddings, 2 + 2 layers of attention, LayerNorm and FFN: |logits − reference| below this
# fraction of the reference's largest logit (measured: about 2e-7 of it; the attention kernel alone is held to
# rtol 1e-5 in float32, kernels/attn/_reference.py)
RTOL_OF_MAX = 1e-5
CONFIGS = [TransformerConfig(32, 4, 64, 2, 50), TransformerConfig(24, 3, 40, 1, 17), TransformerConfig(8, 1, 8, 2, 5)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.d_model}h{c.n_heads}L{c.n_layers}")
@pytest.mark.parametrize("n_src, n_tgt, src_lengths, tgt_lengths", [
    (9, 7, [9, 5], [7, 3]),  # padded batch, Ns != Nt
    (1, 1, [1, 1], [1, 1]),  # one token each
    (13, 20, [13, 1], [1, 20]),  # Nt > Ns, a one-token source, a one-token target
    (17, 5, None, None),  # no padding
])
def test_forward_matches_the_float64_reference(rng, cfg, n_src, n_tgt, src_lengths, tgt_lengths):
    weights = random_weights(cfg, rng)
    src = rng.integers(0, cfg.vocab, (2, n_src))
    tgt = rng.integers(0, cfg.vocab, (2, n_tgt))
    logits = Transformer(cfg, weights).forward(src, tgt, src_lengths, tgt_lengths)
    ref = reference(cfg, weights, src, tgt, src_lengths, tgt_lengths)
    assert logits.shape == (2, n_tgt, cfg.vocab) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref, rtol=0, atol=RTOL_OF_MAX * np.abs(ref).max())


def test_padding_and_causal_masks_hide_what_they_should(rng):
    cfg = CONFIGS[0]
    model = Transformer(cfg, random_weights(cfg, rng))
    src, tgt = rng.integers(0, cfg.vocab, (2, 10)), rng.integers(0, cfg.vocab, (2, 8))
    base = model.forward(src, tgt, [10, 6], [8, 8])
    src2 = src.copy()
    src2[1, 6:] = (src2[1, 6:] + 1) % cfg.vocab  # change only the second source's padding
    np.testing.assert_array_equal(model.forward(src2, tgt, [10, 6], [8, 8])[1], base[1])
    tgt2 = tgt.copy()
    tgt2[:, 5:] = (tgt2[:, 5:] + 1) % cfg.vocab  # change only later target tokens
    later = model.forward(src, tgt2, [10, 6], [8, 8])
    np.testing.assert_array_equal(later[:, :5], base[:, :5])
    assert not np.allclose(later[:, 5:], base[:, 5:])


def test_sinusoidal_encoding_is_the_papers_formula():
    pe = sinusoidal_encoding(50, 9)  # odd d_model: the last sine has no cosine partner
    pos, i = 37, 3
    assert pe[pos, 2 * i] == pytest.approx(np.sin(pos / 10000 ** (2 * i / 9)), abs=1e-12)
    assert pe[pos, 2 * i + 1] == pytest.approx(np.cos(pos / 10000 ** (2 * i / 9)), abs=1e-12)
    assert pe[pos, 8] == pytest.approx(np.sin(pos / 10000 ** (8 / 9)), abs=1e-12)


def test_bad_input_is_refused(rng):
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TransformerConfig(30, 4, 64, 2, 50)
    with pytest.raises(ValueError, match="n_layers"):
        TransformerConfig(32, 4, 64, 0, 50)
    cfg = CONFIGS[0]
    model = Transformer(cfg, random_weights(cfg, rng))
    src = rng.integers(0, cfg.vocab, (2, 4))
    with pytest.raises(ValueError, match="lengths"):
        model.forward(src, src, [5, 4])
    with pytest.raises(ValueError, match="outside"):
        model.forward(src + cfg.vocab, src)
    with pytest.raises(TypeError, match="2-D integer"):
        model.forward(src.astype(float), src)
    with pytest.raises(ValueError, match="lack"):
        Transformer(cfg, {})
    weights = random_weights(cfg, rng)
    with pytest.raises(ValueError, match=r"weights\['enc0.self.bq'\] must have shape"):
        Transformer(cfg, {**weights, "enc0.self.bq": np.zeros(1, np.float32)})  # it would broadcast


def test_decode_refuses_lengths_and_memory_that_do_not_fit(rng):
    # decode's own source lengths and memory: a batch row the lengths left out came back uncomputed (np.empty)
    cfg = CONFIGS[0]
    model = Transformer(cfg, random_weights(cfg, rng))
    src, tgt = rng.integers(0, cfg.vocab, (2, 4)), rng.integers(0, cfg.vocab, (2, 3))
    memory = model.encode(src)
    for lengths in ([4], [0, 4], [9, 4], [2.5, 4]):
        with pytest.raises(ValueError, match="src_ids lengths"):
            model.decode(tgt, memory, lengths)
    with pytest.raises(ValueError, match="at least one sequence"):
        model.forward(src[:0], tgt[:0])
    for bad in (memory[:1], memory[:, :0], memory[..., :-1], memory.tolist(), memory.astype(np.int32)):
        with pytest.raises(ValueError, match="memory must be"):
            model.decode(tgt, bad)
    assert np.array_equal(model.decode(tgt, memory, [4, 4]), model.decode(tgt, memory))
