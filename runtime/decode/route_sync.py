"""RouteSync: sync a layer's routing *before* its experts run, in the layers where misses make that pay
(DevicePass mixin).

A one-sync forward finds an absent expert only at its sync, after every later layer ran on the wrong output:
the repair recomputes from the first missing layer to the end (device_pass.py). A sync placed on one layer's
lookup codes, after its router and before its experts, finds that layer's absent experts before anything used
them: they are read, the layer looks them up again and runs once. A miss there costs its read and no recompute.
Such a sync costs q (a host sync's price in decoder-layer recomputes, segment_repair.py's sync_cost) whether
anything is absent or not, so it pays only in layers that miss often enough.

Per-layer routes ("auto", one-token forwards). Each MoE layer l keeps p_l, the share of recent forwards (decayed,
LAYER_DECAY: about the last 50) in which it read an expert -- at its route sync, or in a repair. A miss left to the
forward's sync costs the layers from l to the end again (R_l), what a repair costs besides (E: the model's head run
again, the repair's reads waited, its rebuild and queueing, the next forward dropped; measured from the repairs'
wall time over the timed forwards' layer time) and a sync; a route sync costs q. So layer l is routed while

    p_l (R_l + E + q) > q

and looked up without a sync otherwise. Early layers (a miss there recomputes most of the forward) route at small
rates, the last layer only when it misses in about q / (1 + E + q) of the forwards; layers that never miss never
sync (on this CPU q ~0.03-0.05, on a Mac's GPU larger). The rates start at 0 (no routes: one sync) and are carried
across generations on the OffloadedModel (`decode_layer_miss`, `decode_repair_extra`). "auto" with routes on cuts
no segments: a routed layer is a segment boundary placed one step earlier, which recomputes nothing (segments
remain for route=False and an explicit segment size).

Verify windows (several tokens, while their owner allows it: runtime/decode/speculative.py) take the same rule with
rates of their own, w_l: a window names several tokens' experts, and a forecast prefetched most of them, so its
layers miss at other rates than one-token forwards do. w_l is the decayed share of recent windows in which layer l
read (LAYER_DECAY per window; carried as `verify_layer_miss`), and E and q are the pass's. Before any window, w_l
starts at twice its threshold in layers that cannot hold every expert (a fresh cache holds the prompt's experts:
the first windows miss), 0 where they can. Windows the forecast keeps covering decay every w_l below its
threshold -- one host sync; layers whose windows keep missing sync before their experts. On
this CPU a repair costs several layer times and a sync ~0.03 of one, so any layer that misses in more than a few
per cent of the windows routes (bench/results/hotpath_speculative_*.txt).

A routed layer calls route() with its lazy codes. route() evaluates them (one host sync: the forward's prefix
is evaluated with them), and if a code names an absent expert it releases the forward's hold (everything built
so far is evaluated), reads the layer's absent experts (the layer's other experts pinned: they never evict each
other), holds again and tells the layer to look up again. Nothing can evict between that lookup and the
forward's sync (the hold), and a read evicts only in its own layer's slots.

Staged forwards. Plain decoding builds token n+1's forward while token n computes (next_forward.py); a forward
that syncs while it is built cannot overlap like that, and here its Python build (~1-2 ms a token) then adds to
the device's time. So a routed one-token forward, when next forwards are built, is *staged*: it is built whole
with no sync -- each routed layer calls stage() with its lazy codes and looks its slots up again in a second
node that only its experts use -- and finish() runs the route syncs (run_stages()): each evaluates the forward
up to one layer's codes and reads what is absent before anything evaluates that layer's experts (their lookup
reads the table when it runs). Between queueing a step and waiting for it, the host builds one layer of the next
forward (runtime/decode/paced_build.py). Verify windows (no next forward) sync as they are built.

With route-ahead on (runtime/decode/route_ahead.py), a route sync also reads back the router lookahead's
forecast of the next layers, computed from this layer's input, and queues the forecast experts that have
no slot as prefetches after this layer's own reads, inside the same release of the hold.

Invariants: a routed layer runs only on codes that name resident experts (only the forward's unrouted layers
can be missing at its sync, and a repair recomputes from the first of them); the codes recorded for the pass
are the ones each layer ran with; reads happen only with no graph pending that reads a slot (the hold is
released exactly around them). A staged forward holds its layers from before any of it is queued (its first
route sync's prefix runs experts) to its own sync, so a shrink applied in between (usable_now()) waits for that
sync; nothing of it is queued but its first route sync; no forward built on its output is queued before its
syncs end.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.decode.route_ahead import RouteAhead
from runtime.decode.segment_repair import RATE_DECAY

# E before a repair was timed, in decoder-layer times: a repair also runs the model's head again, waits for its
# reads, rebuilds and queues with nothing to overlap, and drops the next forward built on the wrong output.
# Measured here ~6 on the synthetic 8-layer model (this CPU backend queues nearly synchronously).
REPAIR_EXTRA = 2.0
# Weight of the past in a layer's miss rate: about the last 50 forwards. The rule routes a layer at rates down to
# q / (R + E + q) (~0.005 here); a memory of ~10 forwards forgets a layer that misses once in 30 before its next
# miss, which then costs a repair.
LAYER_DECAY = 0.98


class RouteSync:
    """Mixin of DevicePass: uses its cache, stats, flush(), _cur (the build's held layers), _loaded, lookup_layers,
    order, index, and SegmentRepair's segment, sync_cost and _n_layers (initialized first)."""

    def _init_route(self, enabled: bool, ahead: bool | str = "off", route_all: bool = False) -> None:
        self.route_enabled = enabled  # False: never routed (segments instead; for comparison)
        self.route_all = route_all  # a forward that routes a layer routes them all (for comparison)
        self.route_windows = False  # forwards of several tokens (verify windows) may route by their rule; set by their owner
        self.route_layers: frozenset = frozenset()  # layers that route() in the forward being built
        # p_l per MoE layer (self.order's order) and R_l, the decoder layers a repair from it recomputes
        carried = getattr(self.om, "decode_layer_miss", None) if self.segment == "auto" else None
        self.layer_miss = np.array(carried if carried is not None and len(carried) == len(self.order)
                                   else np.zeros(len(self.order)), dtype=np.float64)
        self._miss_pos = {l: i for i, l in enumerate(self.order)}
        self._tail = np.array([self._n_layers - self.index[l] for l in self.order], dtype=np.float64)
        self._route_key, self._routes = None, frozenset()  # the last rule's outcome (mask bytes, lookup key)
        self._missed = bool(self.layer_miss.any())  # False while no layer ever read: nothing to weigh per forward
        # E: what a repair costs beyond the layers it recomputes, in decoder-layer times (measured, carried)
        self.repair_extra = getattr(self.om, "decode_repair_extra", None) or REPAIR_EXTRA
        # w_l: verify windows' own rates, in the same order; carried whatever the segment setting (a verify pass has none)
        carried = getattr(self.om, "verify_layer_miss", None)
        self.window_miss = (np.array(carried, dtype=np.float64) if carried is not None and len(carried) == len(self.order)
                            else self._window_prior())
        self._routed_reads = 0  # layers of the forward being built that read at their route()
        self.route_ahead = RouteAhead(self.om, ahead)  # route syncs that also prefetch later layers (route_ahead.py)
        self.ahead_on = False  # whether the forward being built forecasts ahead at its route syncs
        # Staged (one-token forwards while the pass builds next forwards): the routed forward is built whole with
        # no sync; its layers call stage() instead of route(), and finish() syncs their codes in order
        # (run_stages()) while the next forward is built a layer at a time (runtime/decode/paced_build.py).
        self.route_staged = False  # whether the forward being built is staged (set per build)
        self._stages: list = []  # (layer, indices, codes, ahead) of the forward being built, in build order
        self._pacer = None  # the PacedBuild of the next forward, while the pending one's route syncs run

    def _route_set(self, n_tokens: int, segments: bool) -> frozenset:
        """The layers this forward routes (syncs before their experts): a verify window's where w_l (R_l + E + q) > q
        while its owner allows it (route_windows); an "auto" one-token forward's where p_l (R_l + E + q) > q (the module docstring);
        none otherwise."""
        if self.route_windows:  # a verify round's forward (a plain round's too: a window of one token)
            return self.window_routes() & self.lookup_layers
        if n_tokens > 1:
            return frozenset()
        if not (segments and self.routes_per_layer and self._missed):
            return frozenset()
        mask = self._route_mask()
        key = (mask.tobytes(), self.lookup_layers, self._lookup_key)
        if key != self._route_key:  # changes only when a rate crosses its threshold, or the lookups or slots change
            self._route_key = key
            self._routes = (frozenset(l for l, m in zip(self.order, mask.tolist()) if m) & self.lookup_layers
                            & self._short_layers())
            if self.route_all and self._routes:
                self._routes = self.lookup_layers
        return self._routes

    def _short_layers(self) -> frozenset:
        """The MoE layers whose usable slots cannot hold every expert. Only they route: a layer that can hold them
        all misses only until its experts are in (a cold cache, as a pipeline stage's), then never again, and
        routing it on the misses of that start would cost a sync a token for ~100 tokens after."""
        usable = self.cache.usable_now()
        return frozenset(l for l in self.order if usable[l] < self.cache.layouts[l].n_experts)

    def _route_mask(self, rates: np.ndarray | None = None) -> np.ndarray:
        """Per MoE layer (self.order's order): whether its rate (one-token forwards' unless given) makes a route
        sync pay now: p_l (R_l + E + q) > q."""
        q = self.sync_cost
        return (self.layer_miss if rates is None else rates) * (self._tail + self.repair_extra + q) > q

    def window_routes(self) -> frozenset:
        """The MoE layers the next verify window routes by the rule (before the lookups are known): none unless the
        owner allows windows to route (route_windows) and routes are on."""
        if not (self.route_enabled and self.route_windows) or not self.window_miss.any():
            return frozenset()
        return frozenset(l for l, m in zip(self.order, self._route_mask(self.window_miss).tolist()) if m)

    def _window_prior(self) -> np.ndarray:
        """w_l before any window was seen: twice the rule's threshold in a layer that cannot hold all its experts (the
        first windows of a fresh cache, which holds the prompt's experts, miss in every layer: routing them costs a
        sync each, repairing them a recompute each), 0 where every expert has a slot. A layer the forecast covers
        decays below its threshold after ~34 windows (LAYER_DECAY)."""
        q = self.sync_cost
        short = self._short_layers()
        return np.where([l in short for l in self.order], 2 * q / (self._tail + self.repair_extra + q), 0.0)

    def _note_window_misses(self, loaded: dict) -> None:
        """After a verify window its owner lets route: decay every layer's window rate, count the layers that read
        (at their route sync or in a repair)."""
        if not loaded and not self.window_miss.any():
            return
        self._decay_rates(self.window_miss, loaded)
        self.om.verify_layer_miss = self.window_miss

    def _decay_rates(self, rates: np.ndarray, loaded: dict) -> None:
        """One more forward in a decayed rate (in place): every layer's share decays, the layers that read gain."""
        rates *= LAYER_DECAY
        for layer in loaded:
            rates[self._miss_pos[layer]] += 1 - LAYER_DECAY

    def routed_layers_now(self) -> list[int]:
        """The MoE layers a one-token "auto" forward would route now (by the rule alone), for --json."""
        if not (self.routes_per_layer and self._missed):
            return []
        short = self._short_layers()
        return [l for l, m in zip(self.order, self._route_mask().tolist()) if m and l in short]

    def _note_layer_misses(self, loaded: dict) -> None:
        """After an accepted one-token "auto" forward: decay every layer's rate, count the layers that read."""
        if not loaded and not self._missed:
            return  # every rate is 0 (a full budget): nothing to decay
        self._missed = True
        self._decay_rates(self.layer_miss, loaded)
        self.om.decode_layer_miss = self.layer_miss

    def _note_repair_time(self, seconds: float, recomputed: int, forward_s: float) -> None:
        """A one-token forward's repairs took `seconds` from the sync that found the miss to the one that passed,
        recomputing `recomputed` decoder layers: E is the rest, in decoder-layer times (of the timed forwards, or
        before one was timed of this forward's own build-to-sync time, `forward_s`)."""
        layer_s = (self._forward_s or forward_s) / max(1, self._n_layers)
        if layer_s <= 0:
            return
        extra = max(0.0, seconds / layer_s - recomputed)
        self.repair_extra = RATE_DECAY * self.repair_extra + (1 - RATE_DECAY) * extra
        self.om.decode_repair_extra = self.repair_extra

    @property
    def routes_per_layer(self) -> bool:
        """Whether "auto" one-token forwards choose routed layers (then they cut no segments)."""
        return self.route_enabled and self.segment == "auto"

    def _route_config(self, layers: frozenset, staged: bool) -> tuple:
        """(route layers, route-ahead on, staged) of a forward to build: what its modules read while it is built."""
        return layers, bool(layers) and self.route_ahead.active(), bool(layers) and staged

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
