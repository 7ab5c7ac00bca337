"""The original encoder-decoder Transformer (Vaswani et al. 2017, "Attention Is All You Need") in NumPy on the
ioaware kernels: sinusoidal positions, padding and causal masks, multi-head self- and cross-attention through
``kernels.attention``, residuals with post-LayerNorm, the position-wise feed-forward network and the output
projection tied to the shared embedding. Inference only (no dropout, no label smoothing).

Masks through ``kernels.attention``, which takes a causal flag and the keys it is given: sequences are padded at
the end, so a padding mask is the first ``length`` keys of a sequence. A padded query row sees every valid key
(its output is never used; the float64 ``reference`` defines the same).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import kernels
from kernels.dense import matmul_nt

LN_EPS = 1e-6  # LayerNorm epsilon of the authors' tensor2tensor implementation


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of Vaswani et al.'s model: d_model, h heads, d_ff, N layers in the encoder and in the decoder, and one
    vocabulary shared by source and target (§3.4, §5.1)."""

    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    vocab: int

    def __post_init__(self):
        for name in ("d_model", "n_heads", "d_ff", "n_layers", "vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads


# Table 3, "base": d_model 512, h 8, d_ff 2048, N 6; §5.1: a shared source-target BPE vocabulary of about 37000
BASE = TransformerConfig(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab=37000)


def _attention_names(prefix):
    return [prefix + n for n in ("wq", "wk", "wv", "wo")], [prefix + n for n in ("bq", "bk", "bv", "bo")]


def weight_shapes(cfg: TransformerConfig) -> dict:
    """Every parameter's name and shape; linear weights are stored (out, in), as checkpoints store them."""
    d, f = cfg.d_model, cfg.d_ff
    shapes = {"embedding": (cfg.vocab, d)}  # shared by both embeddings and the output projection (§3.4)

    def block(prefix, attentions):
        for a in attentions:
            ws, bs = _attention_names(f"{prefix}{a}.")
            shapes.update({w: (d, d) for w in ws} | {b: (d,) for b in bs})
        for i in range(len(attentions) + 1):
            shapes.update({f"{prefix}ln{i}.gain": (d,), f"{prefix}ln{i}.bias": (d,)})
        shapes.update({f"{prefix}ffn.w1": (f, d), f"{prefix}ffn.b1": (f,), f"{prefix}ffn.w2": (d, f),
                       f"{prefix}ffn.b2": (d,)})

    for i in range(cfg.n_layers):
        block(f"enc{i}.", ["self"])
        block(f"dec{i}.", ["self", "cross"])
    return shapes


def random_weights(cfg: TransformerConfig, rng, std=0.1) -> dict:
    """Small random float32 weights: gains near 1, everything else N(0, std²)."""
    return {name: (rng.standard_normal(shape) * std + (1.0 if name.endswith("gain") else 0.0)).astype(np.float32)
            for name, shape in weight_shapes(cfg).items()}


def sinusoidal_encoding(n: int, d_model: int) -> np.ndarray:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(same); (n, d_model) float64."""
    pos = np.arange(n)[:, None]  # (n, 1)
    rate = 10000.0 ** (-np.arange(0, d_model, 2) / d_model)  # (ceil(d_model / 2),)
    pe = np.zeros((n, d_model))
    pe[:, 0::2] = np.sin(pos * rate)
    pe[:, 1::2] = np.cos(pos * rate[: d_model // 2])
    return pe


def _check_batch(ids, lengths, name, vocab):
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be a 2-D integer array (batch, tokens); got {ids.dtype} {ids.shape}")
    if 0 in ids.shape:  # (NumPy's "zero-size array" from inside the model before)
        raise ValueError(f"{name} must hold at least one sequence of at least one token; got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{name} holds ids outside [0, {vocab})")
    return ids, _check_lengths(lengths, ids.shape[0], ids.shape[1], name)


def _check_lengths(lengths, batch, n, name):
    """The valid tokens of each of ``batch`` sequences of ``n`` (all n where None): one integer in [1, n] each."""
    lengths = np.full(batch, n) if lengths is None else np.asarray(lengths)
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer) or lengths.min(initial=1) < 1 \
            or lengths.max(initial=n) > n:
        raise ValueError(f"{name} lengths must be one integer in [1, {n}] per sequence ({batch}); got {lengths}")
    return lengths


class Transformer:
    """Encoder-decoder forward in float32; ``trace`` (a list) receives (component, output shape) as it runs."""

    def __init__(self, cfg: TransformerConfig, weights: dict):
        missing = set(weight_shapes(cfg)) - set(weights)
        if missing:
            raise ValueError(f"weights lack {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for name, shape in weight_shapes(cfg).items():  # (a bias of shape (1,) would broadcast silently)
            if np.shape(weights[name]) != tuple(shape):
                raise ValueError(f"weights[{name!r}] must have shape {tuple(shape)}; got {np.shape(weights[name])}")
        self.cfg = cfg
        self.w = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in weights.items()}
        self.trace = None

    def _note(self, component, x):
        if self.trace is not None:
            self.trace.append((component, tuple(x.shape)))
        return x

    def _linear(self, x, w, b):
        """x (..., in) · Wᵀ + b for W stored (out, in) (``kernels.dense.matmul_nt``)."""
        y = matmul_nt(np.ascontiguousarray(x.reshape(-1, x.shape[-1])), self.w[w]) + self.w[b]  # (rows, out)
        return y.reshape(x.shape[:-1] + (y.shape[-1],))

    def _layer_norm(self, x, prefix):
        """Ba et al. 2016: (x − mean) / sqrt(var + eps) · gain + bias over the features."""
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + LN_EPS) * self.w[prefix + "gain"] + self.w[prefix + "bias"]

    def _heads(self, x):
        B, n, _ = x.shape
        return x.reshape(B, n, self.cfg.n_heads, self.cfg.d_k).transpose(0, 2, 1, 3)  # (B, h, n, d_k)

    def _attention(self, prefix, x_q, x_kv, key_lengths, causal, name):
        """Multi-head attention (§3.2.2): project, attend per head through ``kernels.attention``, concatenate,
        project. Keys at or after a sequence's length are padding; with ``causal`` (decoder self-attention, the
        queries are the keys) query i also sees no key after i."""
        (wq, wk, wv, wo), (bq, bk, bv, bo) = _attention_names(prefix)
        q = self._heads(self._linear(x_q, wq, bq))  # (B, h, Nq, d_k)
        k = self._heads(self._linear(x_kv, wk, bk))  # (B, h, Nk, d_k)
        v = self._heads(self._linear(x_kv, wv, bv))  # (B, h, Nk, d_k)
        self._note(f"{name}: Q = x W_Q, split into heads", q)
        self._note(f"{name}: K = x W_K, V = x W_V, split into heads", k)
        o = np.empty_like(q)  # (B, h, Nq, d_k)
        for b, n_keys in enumerate(key_lengths):
            kb, vb = np.ascontiguousarray(k[b, :, :n_keys]), np.ascontiguousarray(v[b, :, :n_keys])
            if causal:
                o[b, :, :n_keys] = kernels.attention(np.ascontiguousarray(q[b, :, :n_keys]), kb, vb, causal=True)
                rest = q[b, :, n_keys:]  # padded query rows: every valid key
            else:
                rest = q[b]
            if rest.shape[1]:
                o[b, :, o.shape[2] - rest.shape[1]:] = kernels.attention(np.ascontiguousarray(rest), kb, vb)
        self._note(f"{name}: softmax(QKᵀ/√d_k)V per head", o)
        B, _, n, _ = o.shape
        return self._note(f"{name}: heads concatenated · W_O", self._linear(
            o.transpose(0, 2, 1, 3).reshape(B, n, self.cfg.d_model), wo, bo))

    def _ffn(self, x, prefix):
        """§3.3, eq. 2: max(0, x W₁ + b₁) W₂ + b₂."""
        h = self._note("FFN: max(0, xW₁ + b₁)", np.maximum(0, self._linear(x, prefix + "w1", prefix + "b1")))
        return self._note("FFN: · W₂ + b₂", self._linear(h, prefix + "w2", prefix + "b2"))

    def _embed(self, ids, name):
        """§3.4: the embedding times sqrt(d_model), plus the positional encoding."""
        x = self.w["embedding"][ids] * np.float32(math.sqrt(self.cfg.d_model))  # (B, n, d_model)
        x = x + sinusoidal_encoding(ids.shape[1], self.cfg.d_model).astype(np.float32)
        return self._note(f"{name} embedding + positional encoding", x)

    def encode(self, src_ids, src_lengths=None):
        """The encoder stack: (B, Ns, d_model) memory."""
        src_ids, src_lengths = _check_batch(src_ids, src_lengths, "src_ids", self.cfg.vocab)
        x = self._embed(src_ids, "source")
        for i in range(self.cfg.n_layers):
            p = f"enc{i}."
            x = self._layer_norm(x + self._attention(p + "self.", x, x, src_lengths, False, "encoder self-attention"),
                                 p + "ln0.")
            x = self._note("add & LayerNorm", self._layer_norm(x + self._ffn(x, p + "ffn."), p + "ln1."))
        return x

    def decode(self, tgt_ids, memory, src_lengths=None, tgt_lengths=None):
        """The decoder stack over the encoder's ``memory``, then the output projection: logits (B, Nt, vocab)."""
        tgt_ids, tgt_lengths = _check_batch(tgt_ids, tgt_lengths, "tgt_ids", self.cfg.vocab)
        if not isinstance(memory, np.ndarray) or memory.ndim != 3 or memory.dtype.kind != "f" \
                or memory.shape[0] != tgt_ids.shape[0] or memory.shape[2] != self.cfg.d_model or not memory.shape[1]:
            raise ValueError(f"memory must be the encoder's float array (batch, source tokens, d_model) = "
                             f"({tgt_ids.shape[0]}, Ns >= 1, {self.cfg.d_model}), one sequence per target; got "
                             f"{getattr(memory, 'dtype', type(memory).__name__)} {np.shape(memory)}")
        src_lengths = _check_lengths(src_lengths, memory.shape[0], memory.shape[1], "src_ids")
        x = self._embed(tgt_ids, "target")
        for i in range(self.cfg.n_layers):
            p = f"dec{i}."
            x = self._layer_norm(x + self._attention(p + "self.", x, x, tgt_lengths, True,
                                                     "decoder masked self-attention"), p + "ln0.")
            x = self._layer_norm(x + self._attention(p + "cross.", x, memory, src_lengths, False,
                                                     "decoder cross-attention (Nq ≠ Nk)"), p + "ln1.")
            x = self._note("add & LayerNorm", self._layer_norm(x + self._ffn(x, p + "ffn."), p + "ln2."))
        logits = matmul_nt(np.ascontiguousarray(x.reshape(-1, self.cfg.d_model)), self.w["embedding"])
        return self._note("output projection (tied to the embedding)", logits.reshape(x.shape[:2] + (-1,)))

    def forward(self, src_ids, tgt_ids, src_lengths=None, tgt_lengths=None):
        """Logits (B, Nt, vocab) of the target tokens given the source (teacher forcing)."""
        memory = self.encode(src_ids, src_lengths)
        return self.decode(tgt_ids, memory, src_lengths, tgt_lengths)


def reference(cfg: TransformerConfig, weights: dict, src_ids, tgt_ids, src_lengths=None, tgt_lengths=None):
    """The same forward in float64 NumPy, written to be obviously right: full mask matrices, a plain softmax."""
    w = {name: np.asarray(a, dtype=np.float64) for name, a in weights.items()}
    src_ids, src_lengths = _check_batch(src_ids, src_lengths, "src_ids", cfg.vocab)
    tgt_ids, tgt_lengths = _check_batch(tgt_ids, tgt_lengths, "tgt_ids", cfg.vocab)

    def norm(x, p):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + LN_EPS) * w[p + "gain"] + w[p + "bias"]

    def mha(p, xq, xkv, allowed):  # allowed: (B, Nq, Nk) bool
        def split(x):  # (B, n, d_model) -> (B, h, n, d_k)
            return x.reshape(x.shape[0], x.shape[1], cfg.n_heads, cfg.d_k).transpose(0, 2, 1, 3)
        q, k, v = (split(x @ w[p + n].T + w[p + b]) for x, n, b in ((xq, "wq", "bq"), (xkv, "wk", "bk"),
                                                                    (xkv, "wv", "bv")))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(cfg.d_k)  # (B, h, Nq, Nk)
        s = np.where(allowed[:, None], s, -np.inf)
        p_att = np.exp(s - s.max(-1, keepdims=True))
        p_att /= p_att.sum(-1, keepdims=True)
        o = (p_att @ v).transpose(0, 2, 1, 3).reshape(xq.shape)  # (B, Nq, d_model)
        return o @ w[p + "wo"].T + w[p + "bo"]

    def ffn(x, p):
        return np.maximum(0, x @ w[p + "w1"].T + w[p + "b1"]) @ w[p + "w2"].T + w[p + "b2"]

    def embed(ids):
        return w["embedding"][ids] * math.sqrt(cfg.d_model) + sinusoidal_encoding(ids.shape[1], cfg.d_model)

    ns, nt = src_ids.shape[1], tgt_ids.shape[1]
    src_keys = np.arange(ns)[None, None, :] < src_lengths[:, None, None]  # (B, 1, Ns)
    tgt_keys = np.arange(nt)[None, None, :] < tgt_lengths[:, None, None]  # (B, 1, Nt)
    causal = np.arange(nt)[None, :, None] >= np.arange(nt)[None, None, :]  # (1, Nt, Nt): key j <= query i
    x = embed(src_ids)
    for i in range(cfg.n_layers):
        p = f"enc{i}."
        x = norm(x + mha(p + "self.", x, x, np.broadcast_to(src_keys, (len(x), ns, ns))), p + "ln0.")
        x = norm(x + ffn(x, p + "ffn."), p + "ln1.")
    memory, y = x, embed(tgt_ids)
    for i in range(cfg.n_layers):
        p = f"dec{i}."
        y = norm(y + mha(p + "self.", y, y, tgt_keys & causal), p + "ln0.")
        y = norm(y + mha(p + "cross.", y, memory, np.broadcast_to(src_keys, (len(y), nt, ns))), p + "ln1.")
        y = norm(y + ffn(y, p + "ffn."), p + "ln2.")
    return y @ w["embedding"].T
