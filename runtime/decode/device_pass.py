"""DevicePass: a target forward with expert lookups on the device, one host sync, and repair.

launch(forward) builds the whole forward lazily: every MoE layer whose tokens x k fit its usable slots maps its
router's ids through the cache's persistent device table (no host sync, no Python per expert) and its slots are
held (never evicted, trimmed or overwritten) from the build to the forward's sync; a window that may need more
experts than a layer's slots takes the synced path in that layer. launch() queues the forward with mx.async_eval
and returns at once. finish() makes the one host sync (output, every layer's ids and lookup codes in one array);
if an expert was absent, it repairs instead of discarding (runtime/decode/repair.py) and syncs again.

The pass is an orchestrator over four collaborators, each in its own file and handed what it needs:
- lookup (runtime/decode/lookups.py): which layers look up on the device, the packed read-back, the parse;
- sync and repair (runtime/decode/repair.py): reads, cache rollback from the first missing layer, replay;
- read scheduling: verify windows' route syncs (runtime/decode/window_routes.py), and the next one-token forward
  built before the pending one's sync (runtime/decode/next_forward.py);
- bookkeeping (runtime/decode/bookkeeping.py): each accepted forward's record, booked off the critical path.

The modules see the pass as `cache.active_pass` while a forward is built: they read `lookup_layers`,
`build_held` (layers whose ids may be baked in as slots) and `route_layers`, and call record(), record_synced()
and route().

Invariants: a forward is returned only when every routed expert it read was resident (the same slots, kernels and
weights as the synced path: bit-identical output); every layer a built forward looks up is held from its build to
its sync (or its drop), so a shrink or an eviction waits for it; modules leave device mode and the holds are
released when launch()/finish() return or raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from runtime.decode.bookkeeping import Bookkeeper, ForwardRecord
from runtime.decode.lookups import Lookups
from runtime.decode.next_forward import NextForward
from runtime.decode.pass_stats import PassStats
from runtime.decode.repair import Repair
from runtime.decode.rollback import snapshot_untrimmable
from runtime.decode.window_routes import WindowRoutes


@dataclass
class _Launch:
    forward: Callable  # builds the forward's output (in device mode while the pass builds it)
    cache: list  # the forward's KV caches and state
    n_tokens: int  # tokens in the forward (1, or a verify window)
    snapshot: list  # untrimmable state before it was built (a repair restores it)
    out: object  # its lazy output
    packed: mx.array | None  # its layers' codes and ids in one array (Lookups.pack), None if none looked up
    layers: list  # MoE layers looked up on the device, in packing order
    k: int  # experts per token
    held: frozenset  # the layers it holds, from its build to its sync
    routes: frozenset  # the layers it routes (runtime/decode/window_routes.py)


class DevicePass:
    def __init__(self, om, max_repairs: int | None = None, build_next: bool = True):
        """om: an OffloadedModel (or a pipeline stage's host: cache, modules, replay, decoder_index, top_k,
        telemetry). build_next: launch_next() may build the next one-token forward before the pending
        one's sync (runtime/decode/next_forward.py)."""
        self.om = om
        self.cache = om.cache
        self.modules = om.modules
        self.replay = om.replay
        self.index = om.decoder_index  # MoE layer -> decoder layer (cache) index
        self.order = sorted(self.modules, key=self.index.get)
        self.stats = PassStats()
        self.build_next = build_next
        self.route_windows = False  # whether this pass's forwards are windows that route (set by their owner)
        self.lookups = Lookups(self.cache, self.order, om.top_k)
        self.repair = Repair(self.cache, self.replay, self.index, self.stats, max_repairs or len(self.modules) + 1)
        self.routes = WindowRoutes(self.cache, self.order, self.index, om, self.stats)
        self.books = Bookkeeper(self.cache, self.modules, self.order, om, self.stats)
        self.next = NextForward(self.replay, self.cache, self.stats)
        # Read by the modules while a forward is built (runtime/cache/cached_switch.py):
        self.lookup_layers: frozenset = frozenset()  # layers that look up on the device
        self.build_held: frozenset = frozenset()  # layers held since before this build (may take ids as slots)
        self.route_layers: frozenset = frozenset()  # layers that sync their codes before their experts run
        self._launch: _Launch | None = None
        self._records: list = []  # (layer, ids, codes) recorded by the forward being built
        self._host: dict = {}  # layer -> (ids (T, k), codes (T, k)) of the pending forward, after its sync
        self._synced: dict = {}  # layer -> (ids, [CallStats]) of its synced calls
        self._loaded: dict = {}  # layer -> [(experts read, bytes, ms)] by its repairs and route syncs
        self._accepted: ForwardRecord | None = None  # the last accepted forward, until flush() books it
        self._codes = None  # (layers, codes (L, T, k), eviction mark) of the last sync
        self._syncs0 = 0

    @property
    def pending(self) -> bool:
        """Whether a forward is launched and not finished (after finish(): the promoted next forward)."""
        return self._launch is not None

    @property
    def forward_reads(self) -> dict[int, np.ndarray]:
        """Layer -> the experts the last forward read (at its route syncs and in repairs); until the next launch."""
        return {l: np.concatenate([r for r, _, _ in v]) for l, v in self._loaded.items() if v}

    def window_routes(self) -> frozenset:
        """The layers the next window would route (what its owner settles before it)."""
        return self.routes.layers() if self.route_windows else frozenset()

    # -- called by the modules while a forward is built ----------------------------------------------------------
    def record(self, layer: int, indices: mx.array, codes: mx.array) -> None:
        self._records.append((layer, indices, codes))

    def record_synced(self, layer: int, ids: np.ndarray, calls: list) -> None:
        self._synced[layer] = (ids, calls)

    def route(self, layer: int, indices: mx.array, codes: mx.array) -> bool:
        """A routed layer's sync before its experts run; True when its absent experts were read (look up again)."""
        return self.routes.sync(layer, indices, codes, self.build_held, self._loaded, self.flush)

    # -- one forward -----------------------------------------------------------------------------------------------
    def run(self, forward: Callable, cache: list, n_tokens: int):
        """launch + finish + flush: the evaluated output of forward(), every routed expert resident."""
        self.launch(forward, cache, n_tokens)
        out = self.finish()
        self.flush()
        return out

    def launch(self, forward: Callable, cache: list, n_tokens: int) -> None:
        """Build forward() lazily in device mode and queue it (mx.async_eval); no host sync here (except layers that
        take the synced path and route syncs)."""
        if self._launch is not None:
            raise RuntimeError("launch() while a forward is pending; finish() it first")
        self.lookup_layers = self.lookups.layers(n_tokens)
        if len(self.lookup_layers) < len(self.order):
            self.flush()  # a synced layer's call may evict: the waiting records' recency first
        routes = self.window_routes() & self.lookup_layers
        self._begin()
        self.stats.routed += bool(routes)
        self.replay.start()
        try:
            self._launch = self._build(forward, cache, n_tokens, snapshot_untrimmable(cache), routes)
        except BaseException:
            self.replay.stop()
            raise

    def _begin(self) -> None:
        """A forward becomes the pending one: its records and counters start."""
        self._host, self._synced, self._loaded = {}, {}, {}
        self._syncs0 = self.cache.host_syncs
        self.stats.passes += 1

    def _build(self, forward: Callable, cache: list, n_tokens: int, snapshot: list, routes: frozenset) -> _Launch:
        """Build forward() in device mode, holding its layers from now to its sync, and queue it."""
        held = self.lookup_layers
        self.cache.hold(held)
        self.build_held, self.route_layers, self._records = held, routes, []
        try:
            self.cache.active_pass = self  # every module of the model looks up on the device now
            try:
                out = forward()
            finally:
                self.cache.active_pass = None
            records = self._records
            packed = self.lookups.pack(records) if records else None
            mx.async_eval(out, [] if packed is None else packed)
        except BaseException:
            self.cache.release(held)
            raise
        finally:
            self._records, self.build_held, self.route_layers = [], frozenset(), frozenset()
        self.stats.layer_calls += len(records)
        k = records[0][1].shape[-1] if records else 0
        return _Launch(forward, cache, n_tokens, snapshot, out, packed, [l for l, _, _ in records], k, held, routes)

    def _sync(self, launch: _Launch) -> list[int]:
        """The host sync of a built forward (its hold released after it); returns the MoE layers with an absent expert."""
        try:
            mx.eval(launch.out, [] if launch.packed is None else launch.packed)  # the one sync
            mark = self.cache.eviction_mark()  # still held: the codes name the experts' slots now
        finally:
            self.cache.release(launch.held)
            launch.held = frozenset()
        self.cache.host_syncs += 1
        if launch.packed is None:
            self._codes = None
            return []
        host, codes, missing = self.lookups.parse(launch.layers, launch.k, launch.packed)
        self._host.update(host)
        self._codes = (launch.layers, codes, mark)
        return missing

    def finish(self):
        """The one host sync; repairs until every routed expert was resident. Returns forward()'s output."""
        launch, self._launch = self._launch, None
        if launch is None:
            raise RuntimeError("finish() without launch()")
        repairs = 0
        try:
            missing = self._sync(launch)
            if missing:
                self.next.drop()  # built on this forward's output, which the repair changes
            while missing:
                repairs += 1
                self.repair.check(repairs)
                self.flush()  # the previous forward's recency first: it decides what is evicted
                self.repair.undo(launch.cache, launch.snapshot, launch.n_tokens, missing, self._host, self._synced,
                                 self._loaded)
                launch = self._build(launch.forward, launch.cache, launch.n_tokens, launch.snapshot, launch.routes)
                missing = self._sync(launch)
        except BaseException:
            self.next.drop()
            raise
        finally:
            self.replay.stop()
        for layer in self._synced:  # evaluated by the sync: their slots need no pin any more
            self.modules[layer].release_pending()
        if self.route_windows:
            self.routes.note(self._loaded)
        syncs = self.cache.host_syncs - self._syncs0  # 1 + repairs + route syncs + synced layer calls
        self.stats.repairs += repairs
        self.stats.host_syncs += syncs
        self.stats.multi_sync += syncs > 1
        # A one-token forward that every layer looked up on the device and that read nothing: its codes are the
        # slots it used, and the bookkeeping books it from them (ResidentTables.record_hit_forward).
        hit = self._codes if not repairs and not self._loaded and not self._synced and launch.n_tokens == 1 and \
            self._codes is not None and len(self._codes[0]) == len(self.order) else None
        if self._accepted is not None:  # finished twice without a flush (settle): keep every record, in order
            self.books.add(self._accepted, defer=True)
        self._accepted = ForwardRecord(self._host, self._synced, self._loaded, hit)
        promoted = self.next.promote()  # built before this sync on its output, which stands
        if promoted is not None:
            self._launch = promoted
            self._begin()
        return launch.out

    def settle(self) -> None:
        """Finish a launched forward nobody will read (generation stopped early), repairing it so the caches it
        wrote are right (a kept prompt cache holds its token); a next forward built early is finished too."""
        while self._launch is not None:
            self.finish()

    def can_launch_next(self) -> bool:
        launch = self._launch
        return (self.build_next and launch is not None and not self.next.exists and launch.n_tokens == 1
                and not launch.routes and len(launch.layers) == len(self.order))

    def launch_next(self, make_forward: Callable[[object], Callable]) -> bool:
        """Build make_forward(pending output) -- the next one-token forward, on the pending forward's lazy output --
        and queue it, if the pending forward is a one-token forward every layer looked up on the device with no
        route sync. Returns whether it was built."""
        if not self.can_launch_next():
            return False
        launch = self._launch
        self.next.build(launch.cache, lambda snapshot: self._build(make_forward(launch.out), launch.cache, 1,
                                                                   snapshot, frozenset()))
        return True

    # -- bookkeeping, once per accepted forward ---------------------------------------------------------------------
    def flush(self, defer: bool = False) -> None:
        """Book the last accepted forward (and any waiting): recency, hits/misses, observer, telemetry. With
        `defer`, a hit forward's record may wait for later ones (runtime/decode/bookkeeping.py)."""
        accepted, self._accepted = self._accepted, None
        if accepted is not None:
            self.books.add(accepted, defer)
        else:
            self.books.flush()
