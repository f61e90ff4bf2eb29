"""SegmentRepair: a device pass that also syncs at segment boundaries inside a forward (DevicePass mixin).

When misses are frequent (small budgets), a repair that recomputes every layer after the first miss
costs more than a few extra host syncs. Then a forward (a token, or a verify window) is cut into
segments of S decoder
layers: after each segment's last layer (but the model's last) the pass syncs that segment's lookup
codes with its output (one host sync). If an expert was absent, it reads the segment's flagged
experts, rolls back the caches of the segment's layers from the first one that missed, reruns those
layers on their recorded input (runtime/decode/layer_replay.py) inside the same forward, and goes on
building the next segment. A miss thus recomputes at most one segment and reads only that segment's
flagged experts; the last segment is checked by the pass's own sync, as without segments.

S is chosen per forward from the recent repair rate r (repairs per forward, averaged) and
the ratio q of a host sync's cost to one decoder layer's recompute: the expected cost per token,
r * S / 2 layers recomputed + (L / S - 1) * q, is lowest at S = sqrt(2 q L / r); no segments when
that is at least L (rare misses), nor with sliding-window caches (their repair path is DevicePass's
own). q is measured unless given: a host sync's price on this machine (runtime/observe/sync_probe.py,
probed once per process, the first time segments are considered) over a decoder layer's share of the
recent one-token forwards' wall time (build to sync, less their boundary syncs; forwards that
repaired are not timed); SYNC_COST until a forward was timed. On this CPU q comes out ~0.01-0.05; on
a Mac's GPU (~180 us per sync against a few hundred us per layer) it is larger, and so is S.
With "auto", r is carried across generations on the OffloadedModel (`decode_repair_rate`): a new
generation starts with the segments the last one ended with, not with a full-tail repair. A rerun reuses the arguments the forward passed (a window's attention mask was built once, from
the caches as they were before the forward), so a window repairs within its segment too, where
DevicePass's own repair of a window recomputes it from the first layer.

Invariants (with DevicePass's): a segment's layers are rerun only after every graph reading their
slots was evaluated (the boundary's sync), with the hold released for the reads and taken again
before anything is built; each rerun moves the segment's first missing layer strictly later; a
layer's output goes on into the model only when every expert it read was resident.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from runtime.decode.rollback import roll_back

RATE_DECAY = 0.9  # weight of the past in the repair-rate average (about the last 10 forwards)
SYNC_COST = 0.05  # q before a forward was timed (a sync ~50 us against ~1-2 ms per layer on this CPU)


@functools.lru_cache(maxsize=1)
def sync_seconds() -> float:
    """One host sync's price on this machine, measured once per process (a few ms)."""
    from runtime.observe import host_sync_us

    return host_sync_us(steps=16, rounds=5)["sync_us"] * 1e-6


class SegmentRepair:
    """Mixin of DevicePass: uses its cache, replay, index, records, stats and _parse()."""

    def _init_segments(self, segment, sync_cost: float | None) -> None:
        if segment not in (None, "auto") and (not isinstance(segment, int) or segment < 1):
            raise ValueError(f"segment={segment!r}; expected None, 'auto' or a number of layers >= 1")
        if sync_cost is not None and not sync_cost > 0:
            raise ValueError(f"sync_cost={sync_cost!r}; expected a positive number of layer recomputes, or None")
        self.segment = segment  # None: never; "auto": from the repair rate; S: every S decoder layers
        self._sync_cost = sync_cost  # q if given, else measured (the sync_cost property)
        self._bsyncs0 = 0  # boundary syncs before the pending forward
        self._forward_s = None  # average wall time of a one-token forward that did not repair (build to sync)
        # "auto" carries the rate across generations (plain decoding's passes; verify windows never take segments)
        self.repair_rate = getattr(self.om, "decode_repair_rate", 0.0) if segment == "auto" else 0.0
        self._n_layers = max(self.index.values()) + 1 if self.index else 0  # through the last MoE layer
        self._seg_start = 0  # first record of the open segment
        self._cur = None  # (cache, snapshot, n_tokens, held) of the forward being built

    @property
    def sync_cost(self) -> float:
        """q: a host sync's cost in decoder-layer recomputes (given, or measured: see the module docstring)."""
        if self._sync_cost is not None:
            return self._sync_cost
        if self._forward_s is None:
            return SYNC_COST
        return sync_seconds() / max(self._forward_s / max(1, self._n_layers), 1e-6)

    def _note_forward_time(self, seconds: float, inner_syncs: int) -> None:
        """A one-token forward that read nothing took `seconds` from its build to its sync, `inner_syncs` of them
        inside it (boundaries, route syncs)."""
        if self._sync_cost is not None:
            return
        compute = seconds - inner_syncs * sync_seconds() if inner_syncs else seconds
        if compute > 0:
            self._forward_s = compute if self._forward_s is None else \
                RATE_DECAY * self._forward_s + (1 - RATE_DECAY) * compute

    def segment_size(self) -> int | None:
        """S for the next one-token forward (None: no boundaries)."""
        if self.segment != "auto":
            return self.segment
        if self.repair_rate <= 0:
            return None
        s = round(math.sqrt(2 * self.sync_cost * self._n_layers / self.repair_rate))
        return max(1, s) if s < self._n_layers else None

    def _boundaries(self, cache: list, n_tokens: int) -> frozenset:
        s = None if self.routes_per_layer else self.segment_size()  # routes replace segments (route_sync.py)
        if s is None or s >= self._n_layers or any(isinstance(c, RotatingKVCache) for c in cache):
            return frozenset()
        return frozenset(range(s - 1, self._n_layers - 1, s))

    def _note_repairs(self, n_tokens: int, repairs: int) -> None:
        self.repair_rate = RATE_DECAY * self.repair_rate + (1 - RATE_DECAY) * repairs
        if self.segment == "auto":
            self.om.decode_repair_rate = self.repair_rate

    def _boundary(self, i: int, out: mx.array) -> mx.array:
        """Called by the replay after decoder layer i (a segment's last): sync the segment, repair it."""
        records = self._records[self._seg_start:]
        if not records:
            return out
        missing, host = self._check(out, records)
        self.stats.boundary_syncs += 1
        if not missing:
            self._seg_start = len(self._records)
            return out
        cache, snapshot, n_tokens, held = self._cur
        self.cache.release(held)  # everything built so far is evaluated: the segment's reads may evict
        try:
            while missing:
                self._forward_repairs += 1
                if self._forward_repairs > self.max_repairs:
                    raise RuntimeError(f"a forward still missed experts after {self.max_repairs} repairs")
                self.flush()  # the previous forward's recency first: it decides what is evicted
                first = min(self.index[l] for l in missing)
                needs = {l: np.unique(host[l]) for l in missing}
                for layer, (read, nbytes, ms) in self.cache.load_absent(needs).items():
                    self._loaded.setdefault(layer, []).append((read, nbytes, ms))
                    self.stats.repair_reads += len(read)
                roll_back(cache, snapshot, n_tokens, start=first, stop=i + 1)
                self._records = [r for r in self._records if self.index[r[0]] < first]
                self.stats.recomputed_layers += i + 1 - first
                self.stats.boundary_recomputed += i + 1 - first
                self.stats.boundary_repairs += 1
                self.cache.hold(held)
                try:
                    out = self.replay.input_of(first)
                    for j in range(first, i + 1):
                        out = self.replay.rerun(j, out)
                    missing, host = self._check(out, self._records[self._seg_start:])
                finally:
                    self.cache.release(held)
            self._seg_start = len(self._records)
        finally:
            self.cache.hold(held)  # the rest of the forward is built under the hold, released at its sync
        return out

    def _check(self, out: mx.array, records: list) -> tuple[list, dict]:
        """One host sync of `out` with the records' codes and ids: (layers with an absent expert, layer -> ids)."""
        packed = self._pack(records)
        mx.eval(out, packed)
        self.cache.host_syncs += 1
        layers = [l for l, _, _ in records]
        host = np.array(packed).astype(np.int64, copy=False).reshape(2, len(layers), -1)
        missing = [l for l, row in zip(layers, host[0].tolist()) if max(row) >= self.cache.n_slots(l)]
        return missing, {l: ids for l, ids in zip(layers, host[1])}
