"""Lookups: which MoE layers of a forward look their experts up on the device, and what the forward's sync says.

Shapes: L = MoE layers looked up on the device, T = tokens of the forward, k = experts per token.

A layer looks up on the device when the forward's tokens x k fit its usable slots (a larger window, e.g. a prefill
chunk, takes the synced call there: runtime/cache/cached_switch.py). Each such layer records its expert ids and
lookup codes (a slot, or n_slots + expert when absent: runtime/cache/resident_tables.py); `pack()` puts every
record's codes, then its ids, into one array so the forward's output and all of them come back in one transfer,
and `parse()` reads that array on the host: the ids and codes per layer and the layers with an absent expert.

Invariants: the layer set changes only with the window size or a resize (cached on both); `parse()` names a layer
missing exactly when one of its codes is >= its slot count; records are parsed in the order they were packed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class Lookups:
    def __init__(self, cache, order: list, top_k: int):
        self.cache = cache  # the ExpertCache (usable slots, slot counts)
        self.order = order  # MoE layers in decoder order
        self.top_k = top_k  # experts per token
        self._key, self._layers = None, frozenset()
        self._n_slots = [cache.n_slots(l) for l in order]

    def layers(self, n_tokens: int) -> frozenset:
        """The MoE layers a forward of `n_tokens` looks up on the device (applies pending resizes)."""
        cap = self.top_k * n_tokens
        usable = self.cache.usable_now()
        key = (cap, tuple(usable.values()))
        if key != self._key:
            self._key = key
            self._layers = frozenset(l for l in self.order if cap <= usable[l])
        return self._layers

    @staticmethod
    def pack(records: list) -> mx.array:
        """One array, one transfer: the records' codes (every layer), then their ids."""
        arrays = [c for _, _, c in records] + [i for _, i, _ in records]
        if len({tuple(i.shape) for _, i, _ in records}) == 1 and len({a.dtype for a in arrays}) == 1:
            return mx.stack(arrays)
        return mx.concatenate([a.reshape(-1).astype(mx.int64) for a in arrays])

    def parse(self, layers: list, k: int, packed: mx.array) -> tuple[dict, np.ndarray, list]:
        """The evaluated pack of `layers` -> ({layer: (ids (T, k), codes (T, k))}, codes (L, T, k), missing layers)."""
        n = len(layers)
        host = np.array(packed).astype(np.int64, copy=False).reshape(2, n, -1, k)  # int64: fast indexing
        codes, ids = host[0], host[1]
        per_layer = {layer: (i, c) for layer, i, c in zip(layers, ids, codes)}
        # In Python over a few dozen ints: numpy's broadcasting compare costs ~0.5 ms here right after an eval.
        n_slots = self._n_slots if n == len(self.order) else [self.cache.n_slots(l) for l in layers]
        missing = [l for l, row, s in zip(layers, codes.reshape(n, -1).tolist(), n_slots) if max(row) >= s]
        return per_layer, codes, missing
