"""DevicePass: a target forward with expert lookups on the device, one host sync, and repair.

launch(forward) builds the whole forward lazily: every MoE layer whose tokens x k fit its
usable slots maps its router's ids through the cache's persistent device table (no host
sync, no Python per expert) and its slots are held (never evicted) until the forward is
evaluated; a window that may need more experts than a layer's slots takes the synced split
path in that layer. launch() queues the forward with mx.async_eval and returns at once.

finish() makes the one host sync (output, every layer's ids and lookup codes in one array). If
an expert was absent, it repairs instead of discarding: the layers before the first layer
that missed are kept (their outputs, KV and state are right), every expert flagged absent in
the forward is read at once (parallel reads), the caches of the layers from the first missing
one are rolled back (trim, or restore GatedDeltaNet/rotating state from the snapshot taken at
launch) and the forward is rebuilt from that layer (LayerReplay returns the kept layers'
outputs; a window's layers are called with the arguments, e.g. the mask, of the first build). Each repair moves the first missing layer strictly later (a repaired layer sees the
same input, hence routes to the same, now resident, experts), so there are at most one per
MoE layer.

Lookup codes are slots, or n_slots + expert for an absent expert (runtime/cache/resident_tables.py).
The router lookahead (a module's `lookahead`): a prefetching one keeps its layer's synced call (the
forecast rides on that sync and is queued before the layer's own reads); one attached `in_pass` is
folded in: the layer looks up on the device, its forecast of later layers is built in the same graph,
read back with the same sync and scored, and if its hook asks (in_repairs) a repair also reads the
forecast experts of the layers after the first missing one (runtime/decode/lookahead_pass.py).
A routed one-token forward may be staged instead: built whole, its layers' route syncs run by finish()
while the next forward is built a layer at a time (runtime/decode/route_sync.py, paced_build.py).
Hook for forecasters (prefetch): each of om.forward_hooks is called with the accepted
forward's routing {layer: ids (T, k)} right after its sync, before the next forward is built --
the one moment no device-lookup graph is pending, so prefetches queued there may evict.
The bookkeeping of an accepted forward -- recency, hits and misses, prefetch use, observer,
telemetry, forecast protection -- is queued and done by flush(): plain decoding calls it after
queueing the next forward, so it overlaps that forward's compute; a repair flushes first, so
eviction choices see every earlier use.

Invariants: a forward is returned only when every routed expert it read was resident (the same
slots, kernels and weights as the synced path: bit-identical output); no slot a pending graph
may read is overwritten (held from its build, or a next forward's table-lookup layers from before it is queued, to
its sync); modules leave device mode and the
holds are released when launch()/finish() return or raise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from runtime.decode.forward_calls import ForwardCalls
from runtime.decode.lookahead_pass import PassForecasts
from runtime.decode.next_forward import NextForward
from runtime.decode.pass_stats import PassStats
from runtime.decode.route_sync import RouteSync
from runtime.decode.rollback import roll_back, snapshot_untrimmable
from runtime.decode.segment_repair import SegmentRepair

DEFER_FORWARDS = 16  # hit forwards whose bookkeeping flush(defer=True) books together


@dataclass
class _Launch:
    forward: Callable
    cache: list
    n_tokens: int
    snapshot: list
    out: object
    packed: mx.array | None
    layers: list  # MoE layers looked up on the device in this build, in packing order
    shapes: list  # their ids' shapes
    held: frozenset  # the layers it holds now (a staged forward: from its first route sync to its sync)
    started: float  # perf_counter() when its build began (a paced build: when it became the pending forward)
    stages: list = field(default_factory=list)  # a staged forward's (layer, indices, codes, ahead), in layer order
    route: tuple = (frozenset(), False, False)  # (route layers, route-ahead on, staged) it was built with
    to_hold: frozenset = frozenset()  # layers it will hold, not held yet (built before it could be queued)
    queued: bool = True  # whether it was queued (or a staged one's first route sync) when built


class DevicePass(SegmentRepair, NextForward, RouteSync, ForwardCalls):
    def __init__(self, om, max_repairs: int | None = None, segment: int | str | None = None,
                 sync_cost: float | None = None, build_next: bool = True, route: bool = True,
                 route_ahead: bool | str | None = None, staged: bool = True, route_all: bool = False):
        """segment: repair within segments of S decoder layers (runtime/decode/segment_repair.py): None
        never, "auto" when recent repairs make it pay, or S; sync_cost: q of that file (None: measured).
        build_next: launch_next() may build the next token's forward before the pending one's sync
        (runtime/decode/next_forward.py). route: "auto" may route forwards (runtime/decode/route_sync.py).
        route_ahead: whether routed forwards' route syncs prefetch later layers (True/"on", False/"off", or "auto":
        while reads are slow; runtime/decode/route_ahead.py); None: the model's OffloadConfig.route_ahead.
        staged: routed one-token forwards are built whole and synced by finish() while the next one is built
        (runtime/decode/paced_build.py; with build_next); False: they sync as they are built. route_all: a forward
        that routes a layer routes every layer (for comparison with per-layer routes)."""
        self.om = om
        self.cache = om.cache
        self.modules = om.modules
        self.replay = om.replay
        self.index = om.decoder_index  # MoE layer -> decoder layer (cache) index
        self.order = sorted(self.modules, key=self.index.get)
        self.top_k = om.top_k
        self.max_repairs = max_repairs or len(self.modules) + 1
        self.stats = PassStats()
        self.lookup_layers: frozenset = frozenset()  # read by the modules while in device mode
        self.build_held: frozenset = frozenset()  # layers the forward being built holds (may take ids as slots)
        self._launch: _Launch | None = None
        self._host: dict = {}  # layer -> (ids (T, k), codes (T, k))
        self._synced: dict[int, tuple[np.ndarray, list]] = {}  # layer -> (ids, CallStats) of synced calls
        self._book = None
        self._deferred: list = []  # records of accepted forwards not booked yet (flush(defer=True)), in order
        self._codes, self._mark = None, 0  # the last sync's (layers, lookup codes (L, T, k)), eviction mark
        self._records: list = []
        self._syncs0 = 0
        self._lookup_key, self._lookup = None, frozenset()
        self._n_slots = [self.cache.n_slots(l) for l in self.order]
        self.ahead = PassForecasts(self.index)  # router-lookahead forecasts recorded in the graph
        self._loaded: dict[int, list] = {}  # layer -> [(experts read, bytes, ms)] by this forward's repairs
        self._forward_repairs = 0  # repairs inside this forward (at segment boundaries)
        self._init_segments(segment, sync_cost)
        self._init_next(build_next)
        self._init_route(route, getattr(om, "route_ahead", "off") if route_ahead is None else route_ahead, route_all)
        self.stage_routes = staged

    @property
    def forward_reads(self) -> dict[int, np.ndarray]:
        """Layer -> the experts the last forward read (at its route syncs and in repairs); until the next launch."""
        return {l: np.concatenate([r for r, _, _ in v]) for l, v in self._loaded.items() if v}

    # -- fed by the modules --------------------------------------------------------------
    def record(self, layer: int, indices: mx.array, codes: mx.array) -> None:
        self._records.append((layer, indices, codes))

    def record_ahead(self, layer: int, hook, forecast: list) -> None:
        self.ahead.record(layer, hook, forecast)

    def record_synced(self, layer: int, ids: np.ndarray, calls: list) -> None:
        self._synced[layer] = (ids, calls)

    # -- one forward -----------------------------------------------------------------------
    def run(self, forward: Callable, cache: list, n_tokens: int):
        """launch + finish + flush: the evaluated output of forward(), every routed expert resident."""
        self.launch(forward, cache, n_tokens)
        out = self.finish()
        self.flush()
        return out

    def launch(self, forward: Callable, cache: list, n_tokens: int, segments: bool = True) -> None:
        """Build forward() lazily in device mode and queue it (mx.async_eval); no host sync here
        (except layers that take the synced path, and segment boundaries unless `segments` is False)."""
        if self._launch is not None:
            raise RuntimeError("launch() while a forward is pending; finish() it first")
        cap = self.top_k * n_tokens
        usable = self.cache.usable_now()
        # A layer whose lookahead prefetches keeps its synced call: the forecast rides on that sync.
        synced = tuple((h := self.modules[l].lookahead) is not None and not getattr(h, "in_pass", False)
                       for l in self.order)
        key = (cap, tuple(usable.values()), synced)
        if key != self._lookup_key:  # which layers fit changes only with the window, a resize or a lookahead
            self._lookup_key = key
            self._lookup = frozenset(l for l, s in zip(self.order, synced) if cap <= usable[l] and not s)
        self.lookup_layers = self._lookup
        if self._deferred and len(self._lookup) < len(self.order):
            self.flush()  # a synced layer's call may evict: the waiting records' recency first
        snapshot = snapshot_untrimmable(cache)
        self._host, self._synced = {}, {}
        self.ahead.reset()
        self._syncs0 = self.cache.host_syncs
        self._loaded, self._forward_repairs, self._bsyncs0 = {}, 0, self.stats.boundary_syncs
        # No segments with a router lookahead attached: in a pass its forecast rides on the one sync and widens
        # the repair's reads (runtime/decode/lookahead_pass.py); prefetching ones keep synced calls anyway.
        segments = segments and not any(self.modules[l].lookahead is not None for l in self.order)
        routes = self._route_set(n_tokens, segments)  # the layers whose misses are frequent: they sync first
        self._routed_reads = 0
        # A routed one-token forward is staged when next forwards may be built: built whole, synced layer by layer
        # by finish() while the next one is built (runtime/decode/paced_build.py). Windows sync as they build.
        route = self._route_config(routes, staged=n_tokens == 1 and self.build_next and self.stage_routes)
        self.stats.routed += bool(routes)
        self.replay.start(self._boundaries(cache, n_tokens) if segments and not routes else frozenset(),
                          self._boundary)
        try:
            self._launch = self._build(forward, cache, n_tokens, snapshot, route)
        except BaseException:
            self.replay.stop()
            raise
        self.stats.passes += 1

    def _build(self, forward, cache, n_tokens, snapshot, route: tuple, queue: bool = True) -> _Launch:
        """Build forward() in device mode. `route`: _route_config()'s. `queue`: evaluate it (a staged forward: up
        to its first route sync) as soon as it is built; a paced build is queued when it becomes pending."""
        started = time.perf_counter()
        self.route_layers, self.ahead_on, self.route_staged = route
        staged = route[2]
        # A forward holds its layers from the moment anything may read them to its sync: one queued at once (a
        # staged one too: its prefix runs once queued) from its build; a next forward, queued when it becomes
        # pending, holds from its build only the layers whose ids it takes as slots (their slot numbers are baked
        # into its graph), the others from its queueing: the pending forward's reads (route syncs, repairs) may
        # evict in those while it is built, and never read in a layer whose every expert sits in its own slot.
        held = self.lookup_layers if queue else frozenset(l for l in self.lookup_layers if self.cache.ids_are_slots(l))
        to_hold = self.lookup_layers - held
        self.build_held = held  # the modules take ids as slots only in these layers (runtime/cache/cached_switch.py)
        self._records, self._seg_start, self._cur = [], 0, (cache, snapshot, n_tokens, held)
        self._stages = []
        self.cache.hold(held)
        try:
            self.cache.active_pass = self  # every module of the model looks up on the device now
            try:
                out = forward()
            finally:
                self.cache.active_pass = None
            layers = [l for l, _, _ in self._records]
            shapes = [tuple(i.shape) for _, i, _ in self._records]
            packed = self._pack(self._records) if self._records else None
            stages = self._stages
            if queue and not staged:
                mx.async_eval(out, [] if packed is None else packed, self.ahead.arrays())
            elif queue and stages:  # only up to the first route sync: no layer's experts run before its reads
                self._queue_stage(stages[0])
        except BaseException:
            self.cache.release(held)
            raise
        finally:
            self._records, self._cur, self._stages, self.build_held = [], None, [], frozenset()
        self.stats.layer_calls += len(layers)
        return _Launch(forward, cache, n_tokens, snapshot, out, packed, layers, shapes, held, started, stages, route,
                       to_hold, queue)

    @staticmethod
    def _pack(records: list) -> mx.array:
        """One array, one transfer: the records' codes (every layer), then their ids."""
        arrays = [c for _, _, c in records] + [i for _, i, _ in records]
        if len({tuple(i.shape) for _, i, _ in records}) == 1 and len({a.dtype for a in arrays}) == 1:
            return mx.stack(arrays)
        return mx.concatenate([a.reshape(-1).astype(mx.int64) for a in arrays])

    def _sync(self, launch: _Launch) -> list[int]:
        """The host sync of a built forward; returns the MoE layers with an absent expert."""
        try:
            if launch.to_hold:  # built before it could be queued (while the previous forward computed)
                self.cache.hold(launch.to_hold)
                launch.held, launch.to_hold = launch.held | launch.to_hold, frozenset()
            if launch.stages:  # staged: its route syncs first, each before its layer's experts run
                self.run_stages(launch.stages, launch.held)
            if self._pacer is not None:  # the next forward's last layers are built while this one ends
                mx.async_eval(launch.out, [] if launch.packed is None else launch.packed)
                self._complete_pacer()
            mx.eval(launch.out, [] if launch.packed is None else launch.packed, self.ahead.arrays())  # one sync
            self._mark = self.cache.eviction_mark()  # still held: the codes name the experts' slots now
        finally:
            self.cache.release(launch.held)
            launch.held = frozenset()
        self.cache.host_syncs += 1
        self.ahead.after_sync()
        if launch.packed is None:
            return []
        n, k = len(launch.layers), launch.shapes[0][-1]
        host = np.array(launch.packed).astype(np.int64, copy=False).reshape(2, n, -1, k)  # int64: fast indexing
        codes, ids = host[0], host[1]
        self._codes = (launch.layers, codes)
        for layer, i, c in zip(launch.layers, ids, codes):
            self._host[layer] = (i, c)
        # In Python over a few dozen ints: numpy's broadcasting compare costs ~0.5 ms here right after an eval.
        n_slots = self._n_slots if n == len(self.order) else [self.cache.n_slots(l) for l in launch.layers]
        return [l for l, row, s in zip(launch.layers, codes.reshape(n, -1).tolist(), n_slots) if max(row) >= s]

    def finish(self):
        """The one host sync; repairs until every routed expert was resident. Returns forward()'s output."""
        launch, self._launch = self._launch, None
        if launch is None:
            raise RuntimeError("finish() without launch()")
        loaded = self._loaded  # the repairs' reads, at segment boundaries and here
        try:
            missing = self._sync(launch)
            if missing:
                self._drop_next()  # built on this forward's output, which the repair changes
            repairs, t_repair, recomputed = 0, time.perf_counter(), self.stats.recomputed_layers
            forward_s = t_repair - launch.started  # E's layer time before a forward was timed (route_sync.py)
            while missing:
                repairs += 1
                if repairs > self.max_repairs:
                    raise RuntimeError(f"a forward still missed experts after {self.max_repairs} repairs")
                launch = self._repair(launch, missing, loaded)
                missing = self._sync(launch)
        except BaseException:
            self._drop_next()
            raise
        finally:
            self.replay.stop()
        for layer in self._synced:  # evaluated by the sync: their slots need no pin any more
            self.modules[layer].release_pending()
        repairs += self._forward_repairs
        # A routed forward's layers that read would each have been a repair at S = 1: they keep the rate honest.
        self._note_repairs(launch.n_tokens, repairs + self._routed_reads)
        if self.route_enabled and self.route_windows:
            self._note_window_misses(loaded)
        elif launch.n_tokens == 1 and self.routes_per_layer:
            self._note_layer_misses(loaded)
            if repairs > self._forward_repairs:  # repaired here (no segments with routes): E's sample
                self._note_repair_time(time.perf_counter() - t_repair, self.stats.recomputed_layers - recomputed,
                                       forward_s)
        if not repairs and not self._routed_reads and launch.n_tokens == 1 and self.segment == "auto":
            # q's layer time (segment_repair.py): a forward that read nothing, less the syncs inside it
            inner = self.stats.boundary_syncs - self._bsyncs0 + len(launch.route[0])
            self._note_forward_time(time.perf_counter() - launch.started, inner)
        self._routed_reads = 0
        if self.om.forward_hooks:  # no forward is pending here: a hook's prefetches may evict
            routing = {l: h[0] for l, h in self._host.items()}
            routing.update((l, ids) for l, (ids, _) in self._synced.items())  # layers that took the synced path
            for hook in self.om.forward_hooks:
                hook(routing)
        syncs = self.cache.host_syncs - self._syncs0  # 1 + repairs + synced layer calls
        self.stats.repairs += repairs
        self.stats.host_syncs += syncs
        self.stats.multi_sync += syncs > 1
        layers, codes = self._codes if self._codes is not None else ((), None)
        # A one-token forward that every layer looked up on the device and that needed no reads: its codes are
        # the slots it used, and flush() books it from them (ResidentTables.record_hit_forward).
        hit = (layers, codes, self._mark) if not repairs and not loaded and not self._synced and \
            launch.n_tokens == 1 and len(layers) == len(self.order) else None
        self._codes = None
        self._book = (self._host, self._synced, loaded, self.ahead.take(), hit)
        self._host, self._synced = {}, {}
        self._promote_next()  # built before this sync on its output, which stands: the next pending forward
        return launch.out

    def settle(self) -> None:
        """Finish a launched forward nobody will read (generation stopped early), repairing it so the
        caches it wrote are right (a kept prompt cache holds its token). finish() releases the hold
        whatever happens; a next forward built early is finished too."""
        while self._launch is not None:
            self.finish()

    def _repair(self, launch: _Launch, missing: list[int], loaded: dict) -> _Launch:
        self.flush()  # the previous forward's recency first: it decides what is evicted
        first = missing_at = min(self.index[l] for l in missing)
        if any(isinstance(c, RotatingKVCache) for c in launch.cache):
            # A sliding-window mask is built from the first cache's offset, which a kept layer has already
            # advanced, and a rotating cache's repair restores it whole: recompute every layer then.
            first = 0
        needs = {l: np.unique(self._host[l][0]) for l in missing}
        needs = self.ahead.extend(needs, missing_at, self.cache.usable_now())  # forecasts from right inputs
        self.ahead.drop_from(first)
        for layer, (read, nbytes, ms) in self.cache.load_absent(needs).items():
            loaded.setdefault(layer, []).append((read, nbytes, ms))
            self.stats.repair_reads += len(read)
        roll_back(launch.cache, launch.snapshot, launch.n_tokens, start=first)
        for l in [l for l in self._host if self.index[l] >= first]:
            del self._host[l]
        for l in [l for l in self._synced if self.index[l] >= first]:
            del self._synced[l]
        # A window's mask is built from the first cache's offset too: its layers from `first` on are called
        # with the arguments the first build passed them (runtime/decode/layer_replay.py).
        self.replay.skip(first, same_args=launch.n_tokens > 1)
        self.stats.recomputed_layers += len(launch.cache) - first
        return self._build(launch.forward, launch.cache, launch.n_tokens, launch.snapshot, launch.route)

    # -- bookkeeping, once per accepted forward ------------------------------------------------
    def flush(self, defer: bool = False) -> None:
        """Record the last accepted forward: recency, hits/misses, observer, telemetry. With `defer`, a hit
        forward's record may wait for up to DEFER_FORWARDS - 1 later ones, booked together (right after a
        forward's compute the host's caches are cold: one pass over several records costs less than one
        per token). Whatever may choose a victim books every waiting record first: a repair, a boundary
        repair, a build with synced layers, a forward hook (none is deferred then), flush()."""
        book, self._book = self._book, None
        if book is not None:
            self._deferred.append(book)
            if defer and book[4] is not None and not book[3] and not self.om.forward_hooks and \
                    len(self._deferred) < DEFER_FORWARDS:
                return
        if not self._deferred:
            return
        t0 = time.perf_counter()
        books, self._deferred = self._deferred, []
        for host, synced, loaded, forecasts, hit in books:
            self._book_forward(host, synced, loaded, forecasts, hit)
        self.cache.unprotect()  # the forwards have passed every layer: their forecasts have served
        self.stats.bookkeeping_s += time.perf_counter() - t0

    def _book_forward(self, host: dict, synced: dict, loaded: dict, forecasts: dict, hit: tuple | None) -> None:
        calls = self._hit_calls(host, hit) if hit is not None else None
        if calls is None:
            calls, wasted = self._calls(host, synced, loaded)
            self.stats.wasted_reads += wasted
        modules = self.modules
        for layer, ids, _, _ in calls:
            observer = modules[layer].observer
            if observer is not None:
                observer(layer, ids)
        if self.om.telemetry is not None:
            self.om.telemetry.on_forward(calls)
        if forecasts:
            self.ahead.score(forecasts, {l: h[0] for l, h in host.items()},
                             {l: self.modules[l].lookahead for l in host})
