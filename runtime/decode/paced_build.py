"""PacedBuild: build the next forward a layer at a time, while the pending one computes between its route syncs.

mlx-lm's decode loop builds forward n+1 (Python, ~1-2 ms per token on this CPU) while forward n computes,
so neither the host nor the device waits for the other. A staged routed forward (runtime/decode/route_sync.py)
computes in steps: finish() evaluates it up to each MoE layer's lookup codes in turn and reads what is absent
before that layer's experts run. Forward n+1 cannot be queued before those steps are done (its evaluation
would run forward n's later layers before their reads), but it can be *built*: graph building evaluates
nothing. PacedBuild runs that build in a greenlet that pauses at each MoE layer (RouteSync.stage() calls
pause()), and finish() of forward n resumes it once per route sync, after queueing the step's compute
(mx.async_eval) and before waiting for it: the host builds a layer of n+1 while the device computes a layer
of n.

What belongs to a build is swapped in and out around each resume: the layer replay's record
(runtime/decode/layer_replay.py) and the cache's active pass (modules look up on the device only while it is
set). Everything else the build writes is its own (DevicePass._build sets and clears it).

Invariants: the build runs only inside step()/complete(), never concurrently with the caller (greenlets
switch, they do not run in parallel); outside those calls the caller's replay record and active pass are
in place; a build evaluates nothing (its forward is queued when it becomes the pending forward); complete()
returns the build's result or raises its error, and a PacedBuild is always completed before its forward is
promoted or dropped (a half-built forward has written some layers' caches and not others).
"""

from __future__ import annotations

from typing import Callable

from greenlet import getcurrent, greenlet


class PacedBuild:
    def __init__(self, build: Callable[[], object], replay, cache):
        self._build = build
        self._replay = replay
        self._cache = cache
        saved = replay.park()
        replay.start()  # the next forward's own record, as launching it alone would start it
        self._own_replay = replay.park()
        replay.resume(saved)
        self._own_active = None  # the cache's active pass inside the build (set by the build itself)
        self._glet = greenlet(self._run)
        self.done = False
        self._result = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._result = self._build()
        except BaseException as e:  # re-raised by complete(), in the caller's frame
            self._error = e
        self.done = True

    def pause(self) -> None:
        """Called from inside the build (a MoE layer was built): hand control back to whoever resumed it."""
        if getcurrent() is self._glet:
            self._glet.parent.switch()

    def step(self) -> None:
        """Build until the next pause, or to the end."""
        if self.done:
            return
        outer_replay, outer_active = self._replay.park(), self._cache.active_pass
        self._replay.resume(self._own_replay)
        self._cache.active_pass = self._own_active
        try:
            self._glet.switch()
        finally:
            self._own_replay, self._own_active = self._replay.park(), self._cache.active_pass
            self._replay.resume(outer_replay)
            self._cache.active_pass = outer_active

    def complete(self):
        """Build to the end; returns the build's result (raises its error) and the replay record it made."""
        while not self.done:
            self.step()
        if self._error is not None:
            raise self._error
        return self._result, self._own_replay
