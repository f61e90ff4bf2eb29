"""NextForward: build token n+1's forward on token n's lazy output, before n's sync (DevicePass mixin).

mlx-lm's generate_step builds and queues the next forward before it reads the current token back,
so the host's graph building overlaps the device's compute and the device never waits for Python.
A device pass can do the same only if forward n will be accepted as it is: a repair of n changes
its output, and the next forward, built on the old one, is then wrong. `finish()` of forward n either
promotes forward n+1 to the pending forward (n was accepted) or drops it (n needed a repair): its slots'
hold (if it had one) is released and the one position it wrote is rolled back in every cache (trim, or
the snapshot of the untrimmable state taken before it was built), before n is repaired. How n+1 is built
(`launch_next()`, `_next_plan()`):
- n and n+1 one sync each (no segments would be cut): built at once; queued at once (mx.async_eval, no sync)
  while a repair is unlikely -- the recent repair rate under NEXT_MAX_REPAIR_RATE: a dropped forward that was
  queued costs its whole compute --, else queued when it becomes pending (a drop costs its build only).
- n+1 staged (routed, runtime/decode/route_sync.py) after a one-sync n: built at once, queued (up to its
  first route sync) when it becomes pending. A drop costs only its build, so no rate gate.
- after a staged n: built a layer at a time between n's route syncs (runtime/decode/paced_build.py),
  staged or one sync (then held and queued when it becomes pending); nothing built on n's output may be
  queued before n's route syncs end. A staged n is not repaired (it reads before its layers run).

A dropped forward's graph may still be computing while the repair reads experts into slots it
reads: its output is garbage and never used, and every cache write it made sits at the position
the rebuilt forward n+1 writes again (later graphs take its arrays as inputs, so MLX orders them).

Only for passes whose forwards make no host sync while they are built but a staged forward's, and whose
bookkeeping never evicts between two syncs: every MoE layer looks up on the device (no synced or
prefetching layer), no router lookahead, no forward hooks (their prefetches may evict, which needs no
pending graph), one token per forward. The replay's record of forward n is parked while n+1 is built and
made current again after, so n's repair still skips the layers before its first miss.

Invariants: at most one next forward; it exists only between launch_next() and the pending
forward's finish(); a queued one holds its layers from its queueing to its own sync (or its drop), one not
queued yet holds only the layers whose ids it took as slots (from its build: their slot numbers are in its
graph), and the rest from before any of it is queued; dropping it leaves every cache as forward n left it, and so does a build of it that
raised midway (its first layers' caches are rolled back to where they stood); with no repair, the tokens and
every counter are those of building forward n+1 after n's sync.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from runtime.decode.paced_build import PacedBuild
from runtime.decode.rollback import marks, roll_back, roll_back_to, snapshot_untrimmable

# Repairs per forward (averaged, runtime/decode/segment_repair.py's repair_rate) above which the next
# forward is not built early. A dropped forward costs its whole compute, a kept one saves the host's
# build time (~1 ms of ~12 on this CPU's synthetic 8-layer model; less on a Mac's GPU): it pays while
# repairs are rarer than about build / (build + compute).
NEXT_MAX_REPAIR_RATE = 0.05


class NextForward:
    """Mixin of DevicePass: uses its _launch, _build, replay, cache, modules, stats and _boundaries()."""

    def _init_next(self, enabled: bool) -> None:
        self.build_next = enabled
        self._next = None  # (_Launch, parked replay state) of the forward built before the pending one's sync
        self._undo_next = None  # (cache, rollback marks) of the caches before the next forward's build

    @property
    def pending(self) -> bool:
        """Whether a forward is launched and not finished (after finish(): the promoted next forward)."""
        return self._launch is not None

    def can_launch_next(self) -> bool:
        return self._next_plan() is not None

    def _next_plan(self) -> tuple | None:
        """How the next one-token forward may be built now: (route config, paced, queue), or None."""
        launch = self._launch
        if not (self.build_next and launch is not None and self._next is None and self._pacer is None
                and launch.n_tokens == 1 and not self.om.forward_hooks and len(launch.layers) == len(self.order)
                and all(self.modules[l].lookahead is None for l in self.order)):
            return None
        routes = self._route_set(1, True)
        if routes and not self.stage_routes:
            return None  # it would sync while it is built
        if not routes and self._boundaries(launch.cache, 1):
            return None  # its segment boundaries would sync while it is built
        paced = launch.route[2]  # nothing built on a staged forward's output is queued before its route syncs end
        if routes or paced:
            # Queued only once the pending forward is accepted: built for nothing at worst, never computed for
            # nothing, so no rate gate.
            return self._route_config(routes, staged=True), paced, False
        # Two one-sync forwards: queued at once while a repair of the pending one is unlikely; else queued when it
        # becomes pending (a repair of the pending forward then throws away its build, not its compute).
        return self._route_config(frozenset(), staged=False), False, self.repair_rate <= NEXT_MAX_REPAIR_RATE

    def launch_next(self, make_forward: Callable[[object], Callable]) -> bool:
        """Build make_forward(pending output) -- the next one-token forward, on the pending forward's lazy
        output -- if it is cheap to drop (see the module docstring). Queued at once when the pending forward is
        one sync and the next too; a staged next is queued when it becomes pending; after a staged forward, the
        next one is built a layer at a time between its route syncs (runtime/decode/paced_build.py). Returns
        whether it was (or is being) built."""
        plan = self._next_plan()
        if plan is None:
            return False
        route, paced, queue = plan
        launch = self._launch
        snapshot = snapshot_untrimmable(launch.cache)
        # A build that raises midway has written its first layers' caches only: they go back to these marks.
        self._undo_next = (launch.cache, marks(launch.cache, snapshot))
        build = lambda: self._build(make_forward(launch.out), launch.cache, 1, snapshot, route, queue=queue)  # noqa: E731
        if paced:
            self._pacer = PacedBuild(build, self.replay, self.cache)
        else:
            parked = self.replay.park()
            self.replay.start()
            try:
                self._next = (build(), self.replay.park())
            except BaseException:
                roll_back_to(*self._undo_next)
                raise
            finally:
                self.replay.resume(parked)
        self.stats.next_built += 1
        return True

    def _complete_pacer(self) -> None:
        """Finish the paced build of the next forward (it becomes self._next); on its error, nothing is next."""
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            try:
                self._next = pacer.complete()
            except BaseException:
                roll_back_to(*self._undo_next)  # the layers it built had written their caches
                raise

    def _drop_next(self) -> None:
        """The pending forward needs a repair (or failed): the next one, built on its output, is wrong."""
        if self._pacer is not None:  # built whole first: a half-built forward wrote some layers' caches only
            try:
                self._complete_pacer()
            except Exception:
                self._next = None  # its build failed (rolled back): nothing of it was queued; the next launch() builds it again
        if self._next is None:
            return
        built, _ = self._next
        self._next = None
        self.cache.release(built.held)
        roll_back(built.cache, built.snapshot, built.n_tokens)
        self.stats.next_dropped += 1

    def _promote_next(self) -> None:
        """The pending forward was accepted: the next one is now the pending forward."""
        self._complete_pacer()
        if self._next is None:
            return
        built, state = self._next
        self._next = None
        self._launch = built
        self.replay.resume(state)
        self.stats.routed += bool(built.route[0])  # counted when pending, as launch() counts (a dropped one never is)
        if not built.queued:  # its forward time starts now
            built.started = time.perf_counter()
        if built.to_hold:  # held before any of it is queued: a shrink applied from now on waits for its sync
            self.cache.hold(built.to_hold)
            built.held, built.to_hold = built.held | built.to_hold, frozenset()
        if built.stages:  # staged: queued now, up to its first route sync
            self._queue_stage(built.stages[0])
        elif not built.queued:  # built while the pending forward computed: queued now
            mx.async_eval(built.out, [] if built.packed is None else built.packed, self.ahead.arrays())
        built.queued = True
        self._syncs0 = self.cache.host_syncs
        self._loaded, self._forward_repairs, self._bsyncs0 = {}, 0, self.stats.boundary_syncs
        self.stats.passes += 1
