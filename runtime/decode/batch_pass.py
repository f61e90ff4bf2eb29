"""BatchPass: a batch decode step whose all-resident MoE layers run on the routed ids, with no routing read-back.

Shapes: B = sequences in the step, k = experts per token, L = MoE layers the step runs on its ids.

When every expert of a layer sits in the slot numbered like it (ExpertCache.ids_are_slots: a budget that holds
the whole layer, warmed in order, as the single-sequence device pass uses it), the router's ids (B, k) are the
slots: the layer runs on them directly, nothing is looked up or read back, and the step costs one host sync
(mlx-lm's token read-back) instead of one per MoE layer. `build(forward)` builds such a step lazily with the
modules in device mode (the pass is `cache.active_pass`, runtime/cache/cached_switch.py); mlx-lm's
BatchGenerator queues it (mx.async_eval) and evaluates it at its next step, after building the next one
(runtime/decode/batch.py).

Holds and versions, as the single-sequence device pass's (runtime/decode/device_pass.py):
- every layer a step may run on its ids is held (ExpertCache.hold) before the step is built and stays held until
  the step's output is evaluated (`retire`: evaluated by the caller's token read-back, evaluated here otherwise);
  while held nothing evicts, trims or overwrites the layer's valid slots, so a memory-governor shrink that lands
  mid-step waits for the step;
- a layer runs on its ids only if, when its module is called, it is held by this build and ids_are_slots is true
  (an answer cached on the SlotTable's version, which every lookup code and usable range bumps). A layer that
  stopped being all-resident (a shrink applied between steps) takes the synced path (one read-back, the
  cache's pins) in that step: `lookup_layers` is asked per layer, at the module's call.

The step's routing ids come back after the step was evaluated (no sync of their own): `retire` books them with the
cache (hits, recency: record_forward) and returns them for the step's counters; synced layers' ids are their own.

Invariants: a built step's held layers are released only after its output was evaluated; every call that ran on
ids was in a layer held since before the build with ids_are_slots true at the call; nothing is held after
`release_all()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np



class _RunsOnIds:
    """The layers whose module may run on its ids now: held by the build and all-resident at the call."""

    def __init__(self, batch_pass: "BatchPass"):
        self._pass = batch_pass

    def __contains__(self, layer) -> bool:
        p = self._pass
        return layer in p.build_held and p.cache.ids_are_slots(layer)


@dataclass
class BuiltStep:
    out: mx.array  # the step's lazy output (logits)
    held: frozenset  # the layers held from its build until it is retired
    ids: list = field(default_factory=list)  # (layer, routing ids (B, k) lazy) of the layers that ran on ids
    synced: dict = field(default_factory=dict)  # layer -> (routing ids (B, k) on the host, [CallStats]): synced layers


class BatchPass:
    def __init__(self, om):
        self.om = om
        self.cache = om.cache
        self.order = list(om.moe_layers)
        # Read by the modules while a step is built (runtime/cache/cached_switch.py):
        self.lookup_layers = _RunsOnIds(self)  # asked per layer at its call
        self.build_held: frozenset = frozenset()  # layers held since before this build
        self.route_layers: frozenset = frozenset()  # never: a batch step does not route
        self._step: BuiltStep | None = None  # the step being built
        self.pending: list[BuiltStep] = []  # built steps not yet retired, oldest first

    def all_resident(self) -> frozenset:
        """The MoE layers whose ids are their slots now (pending resizes applied first)."""
        self.cache.usable_now()
        return frozenset(l for l in self.order if self.cache.ids_are_slots(l))

    def build(self, forward) -> mx.array | None:
        """Build forward() with its all-resident layers held and running on their ids; None (nothing built) when
        no layer is all-resident: the caller runs the synced step."""
        layers = self.all_resident()
        if not layers:
            return None
        self.cache.hold(layers)  # before the build: the ids become slots in the graph from here on
        step = self._step = BuiltStep(None, layers)
        self.build_held = layers
        try:
            self.cache.active_pass = self
            try:
                step.out = forward()
            finally:
                self.cache.active_pass = None
        except BaseException:
            self._step = None
            self.build_held = frozenset()
            self._drop(step)
            raise
        self._step, self.build_held = None, frozenset()
        self.pending.append(step)
        return step.out

    # -- called by the modules while a step is built ------------------------------------------------------------
    def record(self, layer: int, indices: mx.array, slots: mx.array) -> None:
        self._step.ids.append((layer, indices))

    def record_synced(self, layer: int, ids: np.ndarray, calls: list) -> None:
        self._step.synced[layer] = (ids, calls)

    def route(self, layer, indices, codes) -> bool:
        raise RuntimeError(f"layer {layer}: a batch step does not route")

    # -- after the step ran ---------------------------------------------------------------------------------------
    def retire(self, keep_last: bool) -> list[dict]:
        """Release the steps the caller's read-back evaluated (all but the newest with `keep_last`, which mlx-lm
        evaluates at its next step); each is evaluated here first (a no-op when it already was). Returns per step
        {layer: routing ids (B, k)}, oldest first, booked with the cache."""
        n = len(self.pending) - (1 if keep_last else 0)
        done, self.pending = self.pending[:max(0, n)], self.pending[max(0, n):]
        routes = []
        for step in done:
            try:
                mx.eval(step.out, [i for _, i in step.ids])
            finally:
                self.cache.release(step.held)
            routes.append(self._book(step))
        return routes

    def release_all(self) -> list[dict]:
        """Retire every pending step (the decoder closes)."""
        return self.retire(keep_last=False)

    def _drop(self, step: BuiltStep) -> None:
        """A build that failed: whatever of it was queued runs before its hold goes."""
        try:
            if step.out is not None:
                mx.eval(step.out)
        finally:
            self.cache.release(step.held)

    def _book(self, step: BuiltStep) -> dict:
        """The step's routing per layer, its on-ids layers booked with the cache (hits, recency) and every layer with
        telemetry, in layer order."""
        host = {layer: np.array(ids).reshape(-1, ids.shape[-1]) for layer, ids in step.ids}
        rows = [(layer, np.unique(ids), 0, 0, 0, 0.0) for layer, ids in host.items()]
        stats = {r[0]: (len(r[1]), st) for r, st in zip(rows, self.cache.record_forward(rows))}
        for layer, (ids, calls) in step.synced.items():
            host[layer] = ids
            stats[layer] = (len(np.unique(ids)), tuple(sum(getattr(c, f) for c in calls) for f in _CALL_FIELDS))
        ordered = [layer for layer in self.order if layer in host]
        if self.om.telemetry is not None:
            self.om.telemetry.on_forward([(layer, host[layer], *stats[layer]) for layer in ordered])
        return {layer: host[layer] for layer in ordered}


_CALL_FIELDS = ("hits", "misses", "prefetch_used", "bytes_read", "stall_ms")  # CallStats, as record_forward returns
