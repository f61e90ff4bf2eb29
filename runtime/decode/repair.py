"""Repair: undo a forward from the first MoE layer that read an absent expert, so it can be rebuilt from there.

A device-pass forward (runtime/decode/device_pass.py) whose sync flags absent experts is not discarded. The
layers before the first layer that missed are kept (their outputs, KV and recurrent state are right; LayerReplay
hands their recorded outputs back to the rebuild), every expert flagged in that forward is read at once (parallel
reads, `ExpertCache.load_absent`), and only the caches of the layers from the first missing one are rolled back
(trim, or the snapshot of untrimmable state taken at launch). A window's layers from there on are called with the
arguments of the first build (its mask was built from the first cache's offset, which a kept layer has advanced).
Models with sliding-window caches recompute from the first layer (a rotating cache's repair restores it whole).

Invariants: `undo()` runs only after the forward's sync (nothing pending reads a slot: the reads may evict); each
repair moves the first missing layer strictly later (a repaired layer sees the same input, hence routes to the
same, now resident, experts), so a forward repairs at most once per MoE layer and `check()` raises past that.
"""

from __future__ import annotations

import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from runtime.decode.rollback import roll_back


class Repair:
    def __init__(self, cache, replay, index: dict, stats, max_repairs: int):
        self.cache = cache  # the ExpertCache (reads)
        self.replay = replay  # the model's LayerReplay (keeps the layers before the first miss)
        self.index = index  # MoE layer -> decoder layer (cache) index
        self.stats = stats  # the pass's PassStats (repair_reads, recomputed_layers)
        self.max_repairs = max_repairs

    def check(self, repairs: int) -> None:
        if repairs > self.max_repairs:
            raise RuntimeError(f"a forward still missed experts after {self.max_repairs} repairs")

    def undo(self, caches: list, snapshot: list, n_tokens: int, missing: list, host: dict, synced: dict,
             loaded: dict) -> None:
        """Read the experts `missing` layers flagged (host: layer -> (ids, codes)), roll the caches back from the first
        missing layer, forget the records of the layers from there (host, synced: edited in place) and tell the
        replay to keep the layers before it. `loaded` (layer -> [(read, bytes, ms)]) gains the reads."""
        first = min(self.index[l] for l in missing)
        if any(isinstance(c, RotatingKVCache) for c in caches):
            first = 0
        needs = {l: np.unique(host[l][0]) for l in missing}
        for layer, (read, nbytes, ms) in self.cache.load_absent(needs).items():
            loaded.setdefault(layer, []).append((read, nbytes, ms))
            self.stats.repair_reads += len(read)
        roll_back(caches, snapshot, n_tokens, start=first)
        for records in (host, synced):
            for layer in [l for l in records if self.index[l] >= first]:
                del records[layer]
        self.replay.skip(first, same_args=n_tokens > 1)
        self.stats.recomputed_layers += len(caches) - first
