"""OneSyncPass: a forward that reads the routers back to the host once, not once per MoE layer.

The normal CachedSwitchGLU call reads its router's choice on the host (one sync per
MoE layer) so the cache can load what is missing before the experts run. When the
experts a forward needs are already resident -- which is what prefetch is for --
those syncs are pure latency. An one_sync pass instead:

1. waits for reads in flight (the round's prefetches) and freezes the cache: every
   valid slot is pinned, and each layer gets a device table expert -> slot (-1: absent);
2. runs the forward with every MoE layer mapping its router's ids through that table
   on the device (an absent expert reads slot 0 and raises the layer's miss flag);
3. evaluates the output together with all ids and miss flags: one host sync;
4. if no flag is up, the output is exactly what the normal path computes (same slots,
   same kernels, same weights) and the cache's bookkeeping, the observer and telemetry
   are fed as the normal path would have; otherwise the output is discarded and the
   caller must undo the pass's cache writes (trim or restore) and run the normal path.

OneSyncModel applies the same to plain decoding: it wraps the model handed to mlx-lm's
generate_step and tries each single-token step as a pass. Whether a pass is tried at
all is OneSyncGate's call, from the measured cost of passes, failures and normal
forwards (gated_forward runs one step that way; snapshot_untrimmable/roll_back undo
a discarded pass).

Invariants: no slot a frozen table names can change until the pass has been evaluated
and thawed; a pass returns an output only if every routed expert was resident; the
modules leave one_sync mode when run() returns or raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from metal import window_switch_glu


@dataclass
class OneSyncStats:
    tries: int = 0  # one_sync passes run
    fallbacks: int = 0  # passes that met an absent expert and were discarded
    settle_ms: float = 0.0  # time waiting for in-flight reads before freezing

    @property
    def success_rate(self) -> float:
        return 1 - self.fallbacks / self.tries if self.tries else 0.0


@dataclass
class _Record:
    indices: mx.array  # the router's expert ids, (..., k)
    miss: mx.array  # scalar bool: some id was absent from the frozen table


class OneSyncPass:
    def __init__(self, om):
        self.om = om  # the OffloadedModel whose modules and cache the pass drives
        self.stats = OneSyncStats()
        self._tables: dict[int, mx.array] = {}
        self._records: dict[int, list[_Record]] = {}

    def run(self, forward: Callable[[], mx.array]) -> mx.array | None:
        """forward() evaluated with device-side expert lookup, or None if an expert was absent."""
        cache, modules = self.om.cache, self.om.modules
        self.stats.tries += 1
        self.stats.settle_ms += cache.settle_inflight()
        for layer in modules:
            cache.usable_slots(layer)  # a resize the memory governor asked for takes effect here too
        frozen = cache.freeze_resident()
        self._tables = {l: mx.array(table) for l, (table, _) in frozen.items()}
        self._records = {l: [] for l in modules}
        try:
            for m in modules.values():
                m.one_sync = self
            out = forward()
            records = [r for rs in self._records.values() for r in rs]
            mx.eval(out, [r.indices for r in records], [r.miss for r in records])
            if any(r.miss.item() for r in records):
                self.stats.fallbacks += 1
                return None
            self._book(cache, modules)
            return out
        finally:
            for m in modules.values():
                m.one_sync = None
            self._tables, self._records = {}, {}
            cache.thaw(frozen)

    def layer_call(self, module, x: mx.array, indices: mx.array) -> mx.array:
        """A CachedSwitchGLU call in one_sync mode: slots looked up on the device."""
        slots = self._tables[module.layer][indices]
        self._records[module.layer].append(_Record(indices, (slots < 0).any()))
        safe = mx.maximum(slots, 0).astype(mx.uint32)  # absent: any slot; the pass is discarded then
        n_tokens = indices.size // indices.shape[-1]
        return window_switch_glu(module.switch, x, safe) if n_tokens > 1 else module.switch(x, safe)

    def _book(self, cache, modules) -> None:
        """What the normal path records per call: cache hits and recency, the observer, telemetry."""
        for layer, records in self._records.items():
            module = modules[layer]
            for r in records:
                ids = np.array(r.indices)
                flat = ids.reshape(-1, ids.shape[-1])
                stats = cache.record_resident_use(layer, np.unique(flat))
                if module.observer is not None:
                    module.observer(layer, flat)
                if module.telemetry is not None:
                    module.telemetry.on_call(layer, flat, [stats])
            cache.unprotect(layer)  # the forecasts of this layer have served


@dataclass
class OneSyncGate:
    """When to try a pass, by measured cost. A success saves t_normal - t_pass; a failure costs
    t_fail (the discarded pass) on top of the normal pass. With p the recent success rate, trying
    pays when p * (t_normal - t_pass) > (1 - p) * t_fail: on a CPU, where a host sync is cheap, that
    needs p near 1; where syncs are dear (Metal) much less. The first `window` calls always try;
    after that, when trying does not pay, only probe now and then, doubling the gap after each
    failed probe up to `max_probe_every` (a successful probe resets it). `min_success` replaces the
    cost rule with a fixed threshold (0.0: always try)."""

    min_success: float | None = None
    window: int = 8  # recent outcomes considered
    probe_every: int = 8  # first gap between probes
    max_probe_every: int = 64
    _recent: list[bool] = field(default_factory=list)
    _skipped: int = 0
    _gap: int = 0  # current gap between probes (0: not backing off yet)
    _probing: bool = False
    _ms: dict = field(default_factory=dict)  # running means: "pass" (succeeded), "fail", "normal"

    def worth_it(self) -> bool:
        p = float(np.mean(self._recent)) if self._recent else 1.0
        if self.min_success is not None:
            return p >= self.min_success
        if "normal" not in self._ms or "pass" not in self._ms:
            return p >= 0.5  # costs not measured yet
        return p * (self._ms["normal"] - self._ms["pass"]) > (1 - p) * self._ms.get("fail", self._ms["pass"])

    def should_try(self) -> bool:
        self._probing = False
        if len(self._recent) < self.window:
            return True
        if self.min_success is None and "normal" not in self._ms:
            return False  # every try succeeded so far: run one normal pass to learn what it costs
        if self.worth_it():
            self._gap, self._skipped = 0, 0
            return True
        self._gap = self._gap or self.probe_every
        self._skipped += 1
        if self._skipped >= self._gap:
            self._skipped, self._probing = 0, True
            return True
        return False

    def record(self, success: bool, ms: float | None = None) -> None:
        """The outcome of a tried pass and, if known, its duration (ms)."""
        if self._probing:
            self._gap = self.probe_every if success else min(2 * self._gap, self.max_probe_every)
        self._recent = (self._recent + [success])[-self.window:]
        if ms is not None:
            self._mean("pass" if success else "fail", ms)

    def record_normal(self, ms: float) -> None:
        """The duration of a normal (per-layer sync) pass."""
        self._mean("normal", ms)

    def _mean(self, key: str, ms: float, alpha: float = 0.2) -> None:
        self._ms[key] = ms if key not in self._ms else (1 - alpha) * self._ms[key] + alpha * ms


# -- rolling caches back after a discarded pass ---------------------------------------------------
def snapshot_untrimmable(cache) -> list:
    """States of the caches that cannot be trimmed (containers copied, arrays shared); None for the rest."""
    return [None if c.is_trimmable() else tree_map(lambda x: x, c.state) for c in cache]


def roll_back(cache, snapshot: list, n: int) -> None:
    """Drop the last n positions a discarded forward wrote: trim, or restore a copy of the snapshot
    (a copy because caches mutate their state containers in place, and a snapshot may serve twice)."""
    for c, s in zip(cache, snapshot):
        if s is None:
            c.trim(n)
        else:
            c.state = tree_map(lambda x: x, s)


class OneSyncModel:
    """The offloaded model as mlx-lm's generate_step sees it: single-token steps are tried as
    one-sync passes (gated), everything else -- prefill chunks, fallbacks -- runs normally."""

    def __init__(self, om, gate: OneSyncGate | None = None):
        self._om = om
        self._pass = OneSyncPass(om)
        self._gate = gate or OneSyncGate()

    @property
    def stats(self) -> OneSyncStats:
        return self._pass.stats

    def __getattr__(self, name):  # layers, make_cache, args ... of the wrapped mlx-lm model
        return getattr(self._om.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        model = self._om.model
        if cache is None or kwargs or inputs.shape[-1] != 1:
            return model(inputs, cache=cache, **kwargs)
        snapshot = snapshot_untrimmable(cache)
        out, _ = gated_forward(self._gate, self._pass, lambda: model(inputs, cache=cache),
                               lambda: roll_back(cache, snapshot, inputs.shape[-1]))
        return out


def gated_forward(gate: OneSyncGate | None, opt: OneSyncPass, forward: Callable[[], mx.array],
                  undo: Callable[[], None]) -> tuple[mx.array, bool | None]:
    """forward() as a one-sync pass if the gate says so (None: always), else or after a failure
    normally, undo() in between; the gate learns each outcome and duration (both paths timed to an
    evaluated output). Returns (output, the pass's success or None if not tried)."""
    tried = gate is None or gate.should_try()
    if tried:
        t0 = time.perf_counter()
        out = opt.run(forward)
        if gate is not None:
            gate.record(out is not None, (time.perf_counter() - t0) * 1e3)
        if out is not None:
            return out, True
        undo()
    t0 = time.perf_counter()
    out = forward()
    if gate is not None:
        mx.eval(out)  # its tail past the last MoE sync (final norm, lm_head) counts too, as in a pass
        gate.record_normal((time.perf_counter() - t0) * 1e3)
    return out, (False if tried else None)
