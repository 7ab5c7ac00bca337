"""Model configurations and the calculators the cost model and the report use: parameter count, weight memory per
precision, KV-cache bytes (GQA aware).

Preset values are each model's published configuration (its ``config.json``; for SmolLM2 also the GGUF header).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

PRECISION_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
SCALE_BYTES = 4  # one float32 absmax per output feature of a quantized matrix (LLM.int8() vector-wise, §3.2)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. ``arch`` is "llama" (RMSNorm, rotary, SwiGLU, no biases) or "gpt2" (LayerNorm,
    learned positions, GELU MLP, biases)."""

    name: str
    arch: str
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    tied_embeddings: bool
    max_positions: int = 0  # learned position embeddings (gpt2)
    rope_base: float = 10000.0
    head_dim: int = field(init=False)

    def __post_init__(self):
        if self.arch not in ("llama", "gpt2"):
            raise ValueError(f"{self.name}: arch must be 'llama' or 'gpt2'; got {self.arch!r}")
        for name in ("n_layers", "hidden", "intermediate", "n_heads", "n_kv_heads", "vocab", "max_positions"):
            value, least = getattr(self, name), 0 if name == "max_positions" else 1
            if not _whole(value) or value < least:  # (2.5 layers counted 98944.0 parameters)
                raise ValueError(f"{self.name}: {name} must be a whole number >= {least}; got {value!r}")
        if not isinstance(self.tied_embeddings, bool):
            raise ValueError(f"{self.name}: tied_embeddings must be a bool; got {self.tied_embeddings!r}")
        if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, numbers.Real) \
                or not math.isfinite(self.rope_base) or self.rope_base <= 1:
            raise ValueError(f"{self.name}: rope_base must be a finite number > 1; got {self.rope_base!r}")
        if self.hidden % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: hidden must divide by n_heads and n_heads by n_kv_heads")
        object.__setattr__(self, "head_dim", self.hidden // self.n_heads)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every matrix of one block that a linear layer holds (what int8/int4 quantize)."""
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = [(self.hidden, q_out), (self.hidden, kv_out), (self.hidden, kv_out), (q_out, self.hidden)]
        if self.arch == "gpt2":
            return attn + [(self.hidden, self.intermediate), (self.intermediate, self.hidden)]
        return attn + [(self.hidden, self.intermediate)] * 2 + [(self.intermediate, self.hidden)]

    def other_parameters(self) -> int:
        """Parameters outside the blocks' matrices: embeddings, LM head (if untied), norms, biases, positions."""
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        if self.arch == "gpt2":
            per_block_vectors = 2 * 2 * self.hidden + sum(out for _, out in self.linear_shapes())  # 2 LN + biases
            final_norm = 2 * self.hidden
            return embed + self.max_positions * self.hidden + self.n_layers * per_block_vectors + final_norm
        return embed + self.n_layers * 2 * self.hidden + self.hidden  # two RMSNorms per block, one final


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(name, value, minimum):
    """A whole number >= minimum, as an int (the calculators' counts: tokens, batch, bytes per element)."""
    if not _whole(value) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}; got {value!r}")
    return int(value)


def parameter_count(cfg: ModelConfig) -> int:
    """All parameters: the blocks' matrices plus ``other_parameters``."""
    matrices = sum(i * o for i, o in cfg.linear_shapes())
    return cfg.n_layers * matrices + cfg.other_parameters()


def weight_bytes(cfg: ModelConfig, precision: str) -> int:
    """Bytes of the weights at ``precision`` ('fp32', 'fp16', 'int8', 'int4').

    fp32/fp16: every parameter at that width. int8/int4: the blocks' linear matrices at that width plus one float32
    scale per output feature (vector-wise absmax), everything else (embeddings, LM head, norms) in fp16, as
    LLM.int8() inference leaves them.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISION_BYTES)}")
    width = PRECISION_BYTES[precision]
    if precision in ("fp32", "fp16"):
        return int(parameter_count(cfg) * width)
    matrices = sum(i * o for i, o in cfg.linear_shapes())
    scales = sum(o for _, o in cfg.linear_shapes()) * SCALE_BYTES
    return int(cfg.n_layers * (matrices * width + scales) + cfg.other_parameters() * PRECISION_BYTES["fp16"])


def kv_cache_bytes_per_token(cfg: ModelConfig, elem_bytes: int = 2) -> int:
    """K and V of one token across all layers: 2 · layers · kv_heads · head_dim · bytes (GQA shrinks kv_heads)."""
    if isinstance(elem_bytes, bool) or not isinstance(elem_bytes, numbers.Real) or not elem_bytes > 0 \
            or not math.isfinite(elem_bytes):  # (0.5: a 4-bit cache, as PRECISION_BYTES' int4)
        raise ValueError(f"elem_bytes must be a finite number > 0; got {elem_bytes!r}")
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * elem_bytes


def kv_cache_bytes(cfg: ModelConfig, tokens: int, *, batch: int = 1, elem_bytes: int = 2) -> int:
    """K and V of ``tokens`` tokens of each of ``batch`` sequences (whole numbers: tokens >= 0, batch >= 1)."""
    return kv_cache_bytes_per_token(cfg, elem_bytes) * _count("tokens", tokens, 0) * _count("batch", batch, 1)


PRESETS = {
    # openai-community/gpt2 config.json: n_layer 12, n_embd 768, n_head 12, n_positions 1024, vocab 50257
    "gpt2": ModelConfig("gpt2", "gpt2", 12, 768, 3072, 12, 12, 50257, tied_embeddings=True, max_positions=1024),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (and the GGUF header): 30 layers, 576, 1536, 9/3 heads
    "smollm2-135m": ModelConfig("smollm2-135m", "llama", 30, 576, 1536, 9, 3, 49152, tied_embeddings=True,
                                rope_base=100000.0),
    # meta-llama/Llama-2-7b-hf config.json: 32 layers, 4096, 11008, 32/32 heads, vocab 32000
    "llama-2-7b": ModelConfig("llama-2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, tied_embeddings=False),
    # meta-llama/Llama-3.1-8B config.json: 32 layers, 4096, 14336, 32/8 heads, vocab 128256, rope_theta 500000
    "llama-3.1-8b": ModelConfig("llama-3.1-8b", "llama", 32, 4096, 14336, 32, 8, 128256, tied_embeddings=False,
                                rope_base=500000.0),
    # mistralai/Mistral-7B-v0.1 config.json: 32 layers, 4096, 14336, 32/8 heads, vocab 32000
    "mistral-7b": ModelConfig("mistral-7b", "llama", 32, 4096, 14336, 32, 8, 32000, tied_embeddings=False),
    # meta-llama/Llama-3.1-70B config.json: 80 layers, 8192, 28672, 64/8 heads, vocab 128256, rope_theta 500000
    "llama-3.1-70b": ModelConfig("llama-3.1-70b", "llama", 80, 8192, 28672, 64, 8, 128256, tied_embeddings=False,
                                 rope_base=500000.0),
}


def get_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
