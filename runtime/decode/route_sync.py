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

Staged forwards. Plain decoding builds token n+1's forward while token n computes (next_forward.py); a forward
that syncs while it is built cannot overlap like that, and here its Python build (~1-2 ms a token) then adds to
the device's time. So a routed one-token forward, when next forwards are built, is *staged*: it is built whole
with no sync -- each layer calls stage() with its lazy codes and looks its slots up again in a second node that
only its experts use -- and finish() runs the route syncs (run_stages()): each evaluates the forward up to one
layer's codes and reads what is absent before anything evaluates that layer's experts (their lookup reads the
table when it runs). Between queueing a step and waiting for it, the host builds one layer of the next forward
(runtime/decode/paced_build.py). Verify windows (several tokens, no next forward) sync as they are built.

With route-ahead on (runtime/decode/route_ahead.py), a route sync also reads back the router lookahead's
forecast of the next layers, computed from this layer's input, and queues the forecast experts that have
no slot as prefetches after this layer's own reads, inside the same release of the hold.

Invariants: a routed layer runs only on codes that name resident experts, so the forward's own sync finds
none absent and it repairs nothing; the codes recorded for the pass are the ones the layer ran with; reads
happen only with no graph pending that reads a slot (the hold is released exactly around them). A staged
forward holds nothing while it is built and nothing of it is queued but its first route sync (its layers are
held from its first route sync to its own sync); no forward built on its output is queued before its syncs end.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.decode.route_ahead import RouteAhead


class RouteSync:
    """Mixin of DevicePass: uses its cache, stats, flush(), _cur (the build's held layers), _loaded, lookup_layers."""

    def _init_route(self, enabled: bool, ahead: bool | str = "off") -> None:
        self.route_enabled = enabled  # False: never routed (segments instead; for comparison)
        self.route_windows = False  # route forwards of several tokens (verify windows); set by their owner
        self.route_layers: frozenset = frozenset()  # layers that route() in the forward being built
        self._routed_reads = 0  # layers of the forward being built that read at their route()
        self.route_ahead = RouteAhead(self.om, ahead)  # route syncs that also prefetch later layers (route_ahead.py)
        self.ahead_on = False  # whether the forward being built forecasts ahead at its route syncs
        # Staged (one-token forwards while the pass builds next forwards): the routed forward is built whole with
        # no sync; its layers call stage() instead of route(), and finish() syncs their codes in order
        # (run_stages()) while the next forward is built a layer at a time (runtime/decode/paced_build.py).
        self.route_staged = False  # whether the forward being built is staged (set per build)
        self._stages: list = []  # (layer, indices, codes, ahead) of the forward being built, in build order
        self._pacer = None  # the PacedBuild of the next forward, while the pending one's route syncs run

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

    def _route_config(self, routed: bool, staged: bool) -> tuple:
        """(route layers, route-ahead on, staged) of a forward to build: what its modules read while it is built."""
        return (self.lookup_layers if routed else frozenset(), bool(routed) and self.route_ahead.active(),
                bool(routed and staged))

    @staticmethod
    def _queue_stage(stage: tuple) -> None:
        """Queue a staged forward up to one route sync's codes (and the forecast read back with them)."""
        _, _, codes, ahead = stage
        mx.async_eval(codes, ahead[1] if ahead else [])

    def route(self, layer: int, indices: mx.array, codes: mx.array, ahead: tuple | None = None) -> bool:
        """Called by a device-mode layer with its lazy codes before its experts run: one host sync; True when
        absent experts were read (the layer must look up again). `ahead`: the router lookahead's lazy forecast
        of later layers from this layer's input (runtime/decode/route_ahead.py), evaluated with the codes; its
        absent experts are queued as prefetches after this layer's own reads."""
        return self._route_sync(layer, indices, codes, ahead, self._cur[3])

    def stage(self, layer: int, indices: mx.array, codes: mx.array, ahead: tuple | None = None) -> None:
        """Called by a device-mode layer of a staged forward instead of route(): run_stages() syncs its codes
        before anything evaluates its experts. The layer looks its slots up again in a node of its own, which
        reads the table when it runs: after this layer's reads. A paced build pauses here (one layer built)."""
        self._stages.append((layer, indices, codes, ahead))
        if self._pacer is not None:
            self._pacer.pause()

    def run_stages(self, stages: list, held) -> None:
        """The route syncs of a built staged forward, in layer order: each evaluates the forward up to that
        layer's codes (every earlier layer's experts ran, their reads done) and reads what is absent. Between
        queueing a step and waiting for it, the next forward's paced build (if any) builds a layer."""
        pacer = self._pacer
        for stage in stages:
            layer, indices, codes, ahead = stage
            if pacer is not None and not pacer.done:
                self._queue_stage(stage)  # the device computes this step ...
                pacer.step()  # ... while the host builds a layer of the next forward
                self.stats.paced_layers += 1
            self._route_sync(layer, indices, codes, ahead, held)

    def _route_sync(self, layer: int, indices: mx.array, codes: mx.array, ahead: tuple | None, held) -> bool:
        mx.eval(codes, ahead[1] if ahead else [])
        self.cache.host_syncs += 1
        self.stats.route_syncs += 1
        # On the host view of the evaluated codes: an MLX op on them (a reshape) would be one more graph and
        # host sync (~80 us here), more than the check itself.
        absent = max(np.asarray(codes).reshape(-1).tolist()) >= self.cache.n_slots(layer)
        if not absent and not ahead:
            return False
        keys = self.route_ahead.absent_keys(self.cache, ahead) if ahead else []
        if not absent and not keys:
            return False
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
