"""A static KV cache: K and V of every layer preallocated for a maximum length and written in place, with a length
counter per layer (gpt-fast's design, on NumPy arrays). Appending a token writes one slot; nothing is copied per
token, where ``np.concatenate`` per layer per token copies the whole cache (O(N) per token, O(N²) per answer).

All layers live in one array each for K and V, (L, Hkv, capacity, d): a decode step that runs every layer in one
parallel region (``kernels.decode.LlamaDecodeStep``) takes the two arrays as they are."""
from __future__ import annotations

import numpy as np

from kernels.decode import huge_page_empty


class KVCache:
    """K and V of every layer, ``keys``/``values`` (L, Hkv, capacity, d) float32, the first ``lengths[layer]``
    slots of each layer in use; ``k[layer]``, ``v[layer]`` are the layers' (Hkv, capacity, d) views.

    Iterating (or indexing) gives each layer's (K, V) views of the slots in use, (Hkv, length, d). A write past
    the capacity reallocates the arrays at twice the size (a copy per doubling, not per token);
    ``SmolLM2.generate`` sizes the cache so that this never happens.
    """

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self._allocate(n_layers, n_kv_heads, capacity, head_dim)
        self.lengths = [0] * n_layers

    def _allocate(self, n_layers, n_kv_heads, capacity, head_dim):
        # on huge pages (``kernels.decode.huge_page_empty``): a decode step reads the whole cache at each token
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        n = int(np.prod(shape))
        self.keys = huge_page_empty(n, np.float32).reshape(shape)  # (L, Hkv, cap, d)
        self.values = huge_page_empty(n, np.float32).reshape(shape)  # (L, Hkv, cap, d)
        self.k, self.v = list(self.keys), list(self.values)  # per layer (Hkv, cap, d) views

    def __len__(self):
        return len(self.k)

    def __getitem__(self, layer):
        n = self.lengths[layer]
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def __iter__(self):
        return (self[layer] for layer in range(len(self)))

    def capacity(self, layer=0) -> int:
        return self.keys.shape[2]

    def reserve(self, layer, n_more):
        """Make room for ``n_more`` slots after the ones in use in ``layer`` (doubling the capacity of every layer
        if short)."""
        need = self.lengths[layer] + n_more
        if need > self.capacity():
            old_k, old_v = self.keys, self.values
            L, Hkv, capacity, d = old_k.shape
            self._allocate(L, Hkv, max(need, 2 * capacity), d)
            for i, n in enumerate(self.lengths):
                self.keys[i, :, :n] = old_k[i, :, :n]
                self.values[i, :, :n] = old_v[i, :, :n]

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
        """A cache with the same content and its own arrays, of ``capacity`` slots (default: the same)."""
        L, Hkv, cap, d = self.keys.shape
        out = KVCache.__new__(KVCache)
        out._allocate(L, Hkv, max(max(self.lengths, default=0), capacity if capacity is not None else cap, 1), d)
        out.lengths = list(self.lengths)
        for i, n in enumerate(self.lengths):
            out.keys[i, :, :n] = self.keys[i, :, :n]
            out.values[i, :, :n] = self.values[i, :, :n]
        return out
