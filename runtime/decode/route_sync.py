"""RouteSync: when misses make every layer sync anyway, sync each layer's routing *before* its experts run
(DevicePass mixin).

Segment repairs (runtime/decode/segment_repair.py) at S = 1 sync after every decoder layer and, when a
layer's experts were absent, read them and run the layer again. The same number of syncs placed one step
earlier -- on the layer's lookup codes, after its router and before its experts -- finds the absent
experts before anything used them: they are read, the layer looks them up again and runs once. A miss
then costs its read and no recompute, no rollback and no replay.

So while "auto" cuts one-token forwards into segments and a sync per layer costs no more than those
segments (L q <= r S / 2 + (L / S - 1) q in segment_repair.py's terms; always at S = 1), the forward is
*routed* instead: every MoE layer that looks up on the device calls route() with its lazy codes. route() evaluates
them (one host sync: the forward's prefix is evaluated with them), and if a code names an absent expert
it releases the forward's hold (everything built so far is evaluated), reads the layer's absent experts
(the layer's other experts pinned: they never evict each other), holds again and tells the layer to look
up again. Nothing can evict between that lookup and the forward's sync (the hold). The rate that decides
S counts a routed forward's layers that read (each would have been a repair at S = 1), so the choice holds
while misses stay that frequent.

With route-ahead on (runtime/decode/route_ahead.py), a route sync also reads back the router lookahead's
forecast of the next layers, computed from this layer's input, and queues the forecast experts that have
no slot as prefetches after this layer's own reads, inside the same release of the hold.

Invariants: a routed layer runs only on codes that name resident experts, so the forward's own sync finds
none absent and it repairs nothing; the codes recorded for the pass are the ones the layer ran with; reads
happen only with no graph pending that reads a slot (the hold is released exactly around them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.decode.route_ahead import RouteAhead


class RouteSync:
    """Mixin of DevicePass: uses its cache, stats, flush(), _cur (the build's held layers) and _loaded."""

    def _init_route(self, enabled: bool, ahead: bool | str = "off") -> None:
        self.route_enabled = enabled  # False: never routed (segments instead; for comparison)
        self.route_windows = False  # route forwards of several tokens (verify windows); set by their owner
        self.route_layers: frozenset = frozenset()  # layers that route() in the forward being built
        self._routed_reads = 0  # layers of the forward being built that read at their route()
        self.route_ahead = RouteAhead(self.om, ahead)  # route syncs that also prefetch later layers (route_ahead.py)
        self.ahead_on = False  # whether the forward being built forecasts ahead at its route syncs

    def _route_each_layer(self, n_tokens: int, segments: bool) -> bool:
        """Whether this "auto" one-token forward is routed: when a sync per layer (L q, in layer recomputes)
        costs no more than the segments it replaces (r S / 2 recomputed + (L / S - 1) q; S = 1 always)."""
        if n_tokens > 1:  # a verify window: routed while its owner says so (runtime/decode/speculative.py)
            return self.route_enabled and self.route_windows
        if not (self.route_enabled and segments and self.segment == "auto"):
            return False
        s = self.segment_size()
        if s is None:
            return False
        q, L, r = self.sync_cost, self._n_layers, self.repair_rate
        return s == 1 or L * q <= r * s / 2 + (L / s - 1) * q

    def route(self, layer: int, indices: mx.array, codes: mx.array, ahead: tuple | None = None) -> bool:
        """Called by a device-mode layer with its lazy codes before its experts run: one host sync; True when
        absent experts were read (the layer must look up again). `ahead`: the router lookahead's lazy forecast
        of later layers from this layer's input (runtime/decode/route_ahead.py), evaluated with the codes; its
        absent experts are queued as prefetches after this layer's own reads."""
        mx.eval(codes, ahead[1] if ahead else [])
        self.cache.host_syncs += 1
        self.stats.route_syncs += 1
        absent = max(codes.reshape(-1).tolist()) >= self.cache.n_slots(layer)
        if not absent and not ahead:
            return False
        keys = self.route_ahead.absent_keys(self.cache, ahead) if ahead else []
        if not absent and not keys:
            return False
        held = self._cur[3]
        self.flush()  # the previous forward's recency first: it decides what is evicted
        self.cache.release(held)  # everything built so far was evaluated by this sync
        try:
            if absent:
                for l, (read, nbytes, ms) in self.cache.load_absent({layer: np.unique(np.array(indices))}).items():
                    self._loaded.setdefault(l, []).append((read, nbytes, ms))
                    self.stats.route_reads += len(read)
            if keys:  # after this layer's own reads: they would wait behind prefetches holding every I/O thread
                self.stats.ahead_prefetched += self.route_ahead.queue(self.cache, keys)
        finally:
            self.cache.hold(held)
        self._routed_reads += absent
        return absent
