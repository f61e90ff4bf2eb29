"""WindowRoutes: which layers of a verify window sync their routing before their experts run, and that sync.

A device-pass forward (runtime/decode/device_pass.py) finds an absent expert only at its one sync, after every
later layer ran on the wrong output: the repair recomputes from the first missing layer to the end. A sync placed
on one layer's lookup codes, after its router and before its experts (a *route sync*), finds that layer's absent
experts before anything used them: they are read, the layer looks them up again and runs once. A miss there costs
its read and no recompute; the sync costs q (in decoder-layer times) whether anything is absent or not.

So each MoE layer l keeps w_l, the decayed share (LAYER_DECAY a window: about the last 50) of recent windows in
which it read an expert, at its route sync or in a repair, and a window routes exactly the layers where

    w_l (R_l + E + q) > q

R_l is the decoder layers a repair from l recomputes, E what a repair costs besides (the model's head again, its
reads waited, the rebuild: REPAIR_EXTRA), q a route sync's price (SYNC_COST). Before any window, w_l starts at
twice its threshold in layers that cannot hold every expert (a fresh cache holds the prompt's experts: the first
windows miss), 0 where they can, and a layer that can hold every expert never routes; the rates carry across generations on the model (`verify_layer_miss`). Windows
the forecast keeps covering decay every w_l below its threshold -- one host sync; layers whose windows keep missing
sync before their experts. Measured: spmoe's verify at 50% takes 17.7 ms a round with routed windows against 27.0
with a sync per layer (bench/results/hotpath_speculative_0ms.txt, rows spmoe and spmoe/off).

The owner decides which forwards are windows (the speculative decoder's verify and plain rounds, a pipeline
stage's forwards); a plain one-token decode forward never routes.

Invariants: a routed layer runs only on codes that name resident experts (only unrouted layers can be missing at
the forward's sync); reads happen only with no graph pending that reads a slot: the forward's hold is released
exactly around them (everything built so far was evaluated by the route sync) and taken again before the layer
looks up again; `before_reads` (the pass's bookkeeping) runs before the first read, so eviction sees every
earlier use.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

SYNC_COST = 0.05  # q: a route sync's price in decoder-layer times (a sync ~50 us against ~1-2 ms per layer here)
REPAIR_EXTRA = 2.0  # E: what a repair costs beyond the layers it recomputes, in decoder-layer times
LAYER_DECAY = 0.98  # weight of the past in a layer's rate: about the last 50 windows


class WindowRoutes:
    def __init__(self, cache, order: list, index: dict, owner, stats):
        self.cache = cache  # the ExpertCache (usable slots, reads, holds)
        self.order = order  # MoE layers in decoder order
        self.owner = owner  # the OffloadedModel (or a pipeline stage's host): carries the rates across generations
        self.stats = stats  # the pass's PassStats (route_syncs, route_reads)
        n_layers = max(index.values()) + 1 if index else 0
        self._pos = {l: i for i, l in enumerate(order)}
        self._tail = np.array([n_layers - index[l] for l in order], dtype=np.float64)  # R_l
        carried = getattr(owner, "verify_layer_miss", None)
        self.miss = (np.array(carried, dtype=np.float64) if carried is not None and len(carried) == len(order)
                     else self._prior())

    def _threshold(self) -> np.ndarray:
        return SYNC_COST / (self._tail + REPAIR_EXTRA + SYNC_COST)

    def _short(self) -> np.ndarray:
        """Per MoE layer: its usable slots cannot hold every expert (only such a layer keeps missing)."""
        usable = self.cache.usable_now()
        return np.array([usable[l] < self.cache.layouts[l].n_experts for l in self.order])

    def _prior(self) -> np.ndarray:
        return np.where(self._short(), 2 * self._threshold(), 0.0)

    def layers(self) -> frozenset:
        """The MoE layers the next window routes by the rule: only layers that cannot hold every expert (one that
        can misses only until its experts are in, as a cold cache's first forwards, and would route for ~50 more)."""
        if not self.miss.any():
            return frozenset()
        routed = (self.miss > self._threshold()) & self._short()
        return frozenset(l for l, m in zip(self.order, routed.tolist()) if m)

    def note(self, loaded: dict) -> None:
        """After a window: every layer's rate decays, the layers that read (route sync or repair) gain."""
        if not loaded and not self.miss.any():
            return
        self.miss *= LAYER_DECAY
        for layer in loaded:
            self.miss[self._pos[layer]] += 1 - LAYER_DECAY
        self.owner.verify_layer_miss = self.miss

    def sync(self, layer: int, indices: mx.array, codes: mx.array, held: frozenset, loaded: dict,
             before_reads: Callable[[], None]) -> bool:
        """The route sync of a layer being built: evaluate its lazy codes (and the forward up to them); read its
        absent experts, if any, with the forward's hold released around the reads. True when experts were read
        (the layer must look up again)."""
        mx.eval(codes)
        self.cache.host_syncs += 1
        self.stats.route_syncs += 1
        # On the host view of the evaluated codes: an MLX op on them would be one more graph and host sync.
        if max(np.asarray(codes).reshape(-1).tolist()) < self.cache.n_slots(layer):
            return False
        before_reads()
        self.cache.release(held)  # everything built so far was evaluated by this sync
        try:
            for l, (read, nbytes, ms) in self.cache.load_absent({layer: np.unique(np.array(indices))}).items():
                loaded.setdefault(l, []).append((read, nbytes, ms))
                self.stats.route_reads += len(read)
        finally:
            self.cache.hold(held)
        return True
