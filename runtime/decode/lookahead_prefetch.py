"""LookaheadPrefetch: queue a router-lookahead forecast as prefetch reads, and score it.

Attached to an OffloadedModel (OffloadedModel.set_lookahead), it is called by each
cache-backed MoE module on the normal path: start(layer, x) returns the lazy forecast
of the layers ahead (predictor/lookahead.py), which the module evaluates together with
its own routing (one host sync, as before); finish(layer, forecast, ids) then
- scores the forecasts made earlier for `layer` against the experts it really used
  (recall and precision per distance), and
- unless only scoring, queues the new forecasts on the loader through
  ExpertCache.prefetch (prefetch priority, below every demand read; each forecast expert
  is protected from eviction until its layer's call, which ends the protection).

In one-sync device passes (runtime/decode/device_pass.py) a layer with this hook keeps its
synced call (one host sync per such layer, as on the per-layer path), unless `in_pass`: then the
pass records start()'s forecasts in its graph, reads them back with its one sync, scores them
with finish(..., queue=False) and, with `in_repairs`, adds them to a repair's reads
(runtime/decode/lookahead_pass.py). No layer waits for a sync there, so nothing is prefetched.

A runtime gate switches queueing off when it does not pay: once `probe` prefetched
experts have been scored, if fewer than `min_precision` of them were used, reads stop
and only scoring continues; after 8 x `probe` layer calls the gate tries again. (Whether
a lookahead pays at all, and how far ahead, is the tuner's call, by measured tok/s.)

Invariants: the hook never changes what is computed, only what is read when; forecasts
not reached by their layer within the forward are dropped at the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.decode.forecast_score import ForecastScore
from storage import ExpertKey


@dataclass
class LookaheadStats:
    by_distance: dict[int, ForecastScore] = field(default_factory=dict)
    forecasts: int = 0  # target-layer forecasts made
    queued_bytes: int = 0  # bytes of prefetch reads queued
    gated_off: int = 0  # forecasts not queued because the gate had switched prefetch off

    def to_json(self) -> dict:
        return {"recall": {j: s.recall for j, s in self.by_distance.items()},
                "precision": {j: s.precision for j, s in self.by_distance.items()},
                "forecasts": self.forecasts, "queued_bytes": self.queued_bytes, "gated_off": self.gated_off}


class LookaheadPrefetch:
    def __init__(self, cache, lookahead, first_layer: int, *, queue: bool = True, min_precision: float = 0.25,
                 probe: int = 256, in_pass: bool = False):
        self.cache = cache  # the ExpertCache to prefetch into
        self.lookahead = lookahead  # a predictor.lookahead.RouterLookahead
        self.first_layer = first_layer  # the first MoE layer: its call opens a new forward
        self.queue = queue  # False: score only (recall measurements)
        self.min_precision = min_precision
        self.probe = probe
        # In one-sync device passes: False keeps each source layer's synced call (prefetch as on the per-layer
        # path); True folds the forecast into the pass (no sync of its own, scored, no prefetch; lookahead_pass.py).
        self.in_pass = in_pass
        self.in_repairs = False  # in_pass: a repair also reads the forecast experts of the layers after the miss
        self.stats = LookaheadStats({j: ForecastScore() for j in lookahead.distances})
        self._open: dict[int, list[tuple[int, np.ndarray]]] = {}  # target layer -> [(distance, experts)]
        self._window = ForecastScore()  # precision of queued forecasts since the gate last decided
        self._on = True
        self._skipped = 0  # layer calls since the gate switched queueing off

    @property
    def prefetching(self) -> bool:
        return self.queue and self._on

    def start(self, layer: int, x):
        """The lazy forecast from `layer`'s MoE input, or [] (nothing to forecast from here)."""
        return self.lookahead.forecast(layer, x)

    def finish(self, layer: int, forecast, ids: np.ndarray, queue: bool = True) -> None:
        """Score the forecasts made earlier for `layer` against `ids` (its routing), record `forecast`
        (from start(), lazy or evaluated) and, if `queue` and the gate allows, queue it as prefetch reads."""
        if layer == self.first_layer:
            self._open = {}
        used = np.unique(ids)
        for j, experts in self._open.pop(layer, []):
            hits = int(np.isin(experts, used).sum())
            for s in (self.stats.by_distance[j],) + ((self._window,) if self.prefetching else ()):
                s.hits += hits
                s.forecast += len(experts)
                s.actual += len(used)
        self._gate()
        keys = []
        for hop, top in forecast:
            experts = self.lookahead.experts(top)
            self._open.setdefault(hop.target, []).append((hop.distance, experts))
            self.stats.forecasts += 1
            keys += [ExpertKey(hop.target, int(e)) for e in experts]
        if keys and queue:
            if self.prefetching:
                self.stats.queued_bytes += self.cache.prefetch(keys, round_id=None)
            else:
                self.stats.gated_off += self.queue

    def _gate(self) -> None:
        """Stop queueing when too few prefetched experts are used; probe again now and then."""
        if not self.queue:
            return
        if self._on and self._window.forecast >= self.probe:
            self._on = self._window.precision >= self.min_precision
            self._window = ForecastScore()
        elif not self._on:
            self._skipped += 1
            if self._skipped >= 8 * self.probe:
                self._on, self._skipped = True, 0
