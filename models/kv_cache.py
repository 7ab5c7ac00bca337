"""A static KV cache: per layer, K and V preallocated for a maximum length and written in place, with a length
counter per layer (gpt-fast's design, on NumPy arrays). Appending a token writes one slot; nothing is copied per
token, where ``np.concatenate`` per layer per token copies the whole cache (O(N) per token, O(N²) per answer)."""
from __future__ import annotations

import numpy as np


class KVCache:
    """K and V of every layer, each (Hkv, capacity, d) float32, the first ``lengths[layer]`` slots in use.

    Iterating (or indexing) gives each layer's (K, V) views of the slots in use, (Hkv, length, d). A write past
    the capacity reallocates that layer's arrays at twice the size (a copy per doubling, not per token);
    ``SmolLM2.generate`` sizes the cache so that this never happens.
    """

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self.k = [np.empty((n_kv_heads, capacity, head_dim), dtype=np.float32) for _ in range(n_layers)]
        self.v = [np.empty((n_kv_heads, capacity, head_dim), dtype=np.float32) for _ in range(n_layers)]
        self.lengths = [0] * n_layers

    def __len__(self):
        return len(self.k)

    def __getitem__(self, layer):
        n = self.lengths[layer]
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def __iter__(self):
        return (self[layer] for layer in range(len(self)))

    def capacity(self, layer=0) -> int:
        return self.k[layer].shape[1]

    def reserve(self, layer, n_more):
        """Make room for ``n_more`` slots after the ones in use in ``layer`` (doubling the capacity if short)."""
        need = self.lengths[layer] + n_more
        if need > self.capacity(layer):
            n = self.lengths[layer]
            capacity = max(need, 2 * self.capacity(layer))  # once: K's growth must not double V's again
            for arrays in (self.k, self.v):
                grown = np.empty((arrays[layer].shape[0], capacity, arrays[layer].shape[2]),
                                 dtype=np.float32)  # (Hkv, new capacity, d)
                grown[:, :n] = arrays[layer][:, :n]
                arrays[layer] = grown

    def append(self, layer, k, v):
        """Write k, v (Hkv, t, d) into the next t slots of ``layer``."""
        t = k.shape[1]
        self.reserve(layer, t)
        n = self.lengths[layer]
        self.k[layer][:, n:n + t] = k
        self.v[layer][:, n:n + t] = v
        self.lengths[layer] = n + t

    def replace(self, layer, k, v):
        """Make k, v (Hkv, t, d) the whole content of ``layer`` (a compressed cache), written into its arrays."""
        self.lengths[layer] = 0
        self.append(layer, k, v)

    def copy(self, capacity=None):
        """A cache with the same content and its own arrays, of ``capacity`` slots per layer (default: the same)."""
        out = KVCache.__new__(KVCache)
        out.k, out.v, out.lengths = [], [], list(self.lengths)
        for layer, n in enumerate(self.lengths):
            cap = max(n, capacity if capacity is not None else self.capacity(layer), 1)
            for src, dst in ((self.k, out.k), (self.v, out.v)):
                a = np.empty((src[layer].shape[0], cap, src[layer].shape[2]), dtype=np.float32)  # (Hkv, cap, d)
                a[:, :n] = src[layer][:, :n]
                dst.append(a)
        return out
