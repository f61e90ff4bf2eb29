"""OptimisticPass: a forward that reads the routers back to the host once, not once per MoE layer.

The normal CachedSwitchGLU call reads its router's choice on the host (one sync per
MoE layer) so the cache can load what is missing before the experts run. When the
experts a forward needs are already resident -- which is what prefetch is for --
those syncs are pure latency. An optimistic pass instead:

1. waits for reads in flight (the round's prefetches) and freezes the cache: every
   valid slot is pinned, and each layer gets a device table expert -> slot (-1: absent);
2. runs the forward with every MoE layer mapping its router's ids through that table
   on the device (an absent expert reads slot 0 and raises the layer's miss flag);
3. evaluates the output together with all ids and miss flags: one host sync;
4. if no flag is up, the output is exactly what the normal path computes (same slots,
   same kernels, same weights) and the cache's bookkeeping, the observer and telemetry
   are fed as the normal path would have; otherwise the output is discarded and the
   caller must undo the pass's cache writes (trim or restore) and run the normal path.

Invariants: no slot a frozen table names can change until the pass has been evaluated
and thawed; a pass returns an output only if every routed expert was resident; the
modules leave optimistic mode when run() returns or raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from metal import window_switch_glu


@dataclass
class OptimisticStats:
    tries: int = 0  # optimistic passes run
    fallbacks: int = 0  # passes that met an absent expert and were discarded
    settle_ms: float = 0.0  # time waiting for in-flight reads before freezing

    @property
    def success_rate(self) -> float:
        return 1 - self.fallbacks / self.tries if self.tries else 0.0


@dataclass
class _Record:
    indices: mx.array  # the router's expert ids, (..., k)
    miss: mx.array  # scalar bool: some id was absent from the frozen table


class OptimisticPass:
    def __init__(self, om):
        self.om = om  # the OffloadedModel whose modules and cache the pass drives
        self.stats = OptimisticStats()
        self._tables: dict[int, mx.array] = {}
        self._records: dict[int, list[_Record]] = {}

    def run(self, forward: Callable[[], mx.array]) -> mx.array | None:
        """forward() evaluated with device-side expert lookup, or None if an expert was absent."""
        cache, modules = self.om.cache, self.om.modules
        self.stats.tries += 1
        self.stats.settle_ms += cache.settle_inflight()
        frozen = cache.freeze_resident()
        self._tables = {l: mx.array(table) for l, (table, _) in frozen.items()}
        self._records = {l: [] for l in modules}
        try:
            for m in modules.values():
                m.optimistic = self
            out = forward()
            records = [r for rs in self._records.values() for r in rs]
            mx.eval(out, [r.indices for r in records], [r.miss for r in records])
            if any(r.miss.item() for r in records):
                self.stats.fallbacks += 1
                return None
            self._book(cache, modules)
            return out
        finally:
            for m in modules.values():
                m.optimistic = None
            self._tables, self._records = {}, {}
            cache.thaw(frozen)

    def layer_call(self, module, x: mx.array, indices: mx.array) -> mx.array:
        """A CachedSwitchGLU call in optimistic mode: slots looked up on the device."""
        slots = self._tables[module.layer][indices]
        self._records[module.layer].append(_Record(indices, (slots < 0).any()))
        safe = mx.maximum(slots, 0).astype(mx.uint32)  # absent: any slot; the pass is discarded then
        n_tokens = indices.size // indices.shape[-1]
        return window_switch_glu(module.switch, x, safe) if n_tokens > 1 else module.switch(x, safe)

    def _book(self, cache, modules) -> None:
        """What the normal path records per call: cache hits and recency, the observer, telemetry."""
        for layer, records in self._records.items():
            module = modules[layer]
            for r in records:
                ids = np.array(r.indices)
                flat = ids.reshape(-1, ids.shape[-1])
                stats = cache.record_resident_use(layer, np.unique(flat))
                if module.observer is not None:
                    module.observer(layer, flat)
                if module.telemetry is not None:
                    module.telemetry.on_call(layer, flat, [stats])
            cache.unprotect(layer)  # the forecasts of this layer have served


@dataclass
class OptimismGate:
    """When to try a pass: always while they mostly succeed; after repeated fallbacks only
    every `probe_every`-th time, so a cache that cannot hold the window costs little."""

    probe_every: int = 8
    window: int = 8  # recent outcomes considered
    min_success: float = 0.5
    _recent: list[bool] = field(default_factory=list)
    _skipped: int = 0

    def should_try(self) -> bool:
        if len(self._recent) < self.window or np.mean(self._recent) >= self.min_success:
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def record(self, success: bool) -> None:
        self._recent = (self._recent + [success])[-self.window:]
