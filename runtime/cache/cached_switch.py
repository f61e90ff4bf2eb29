"""CachedSwitchGLU: a drop-in for mlx-lm's SwitchGLU whose experts live in an ExpertCache.

Shapes: N = tokens in the call, k = experts per token, D = hidden, S = cache slots.
    x: (..., D), indices: (..., k) expert ids  ->  (..., k, D), the SwitchGLU contract.

The module keeps the family's own expert module (runtime/cache/slab_switch.py) whose
stacked weights are the cache's slabs ([S, ...] instead of [E, ...]) and calls it with
slot ids, so the arithmetic is mlx-lm's own and the output is bit-identical to the
resident model.

Invariants:
- Before a call touches the slabs, every earlier output of this module has been
  evaluated and its slots unpinned (so eviction never races a pending graph).
- A call whose unique experts exceed the usable slots, or a prefill-sized call with
  experts to read, runs expert-major (runtime/cache/expert_major.py): each unique expert
  read once, reads overlapping compute. Other calls too large for the slots would be
  split into token groups that each fit (split_by_capacity).
- A normal call reads the router's choice back to the host (one sync per MoE layer). A decode token's call
  (one token, no device pass, no observer) does the general path's release, bookkeeping, pins and telemetry
  with its unique experts known once, in one lock round trip when all are valid (_token_call).
- Inside a device pass (runtime/decode/device_pass.py), a call whose tokens x k fit the
  layer's usable slots maps the router's ids through the cache's persistent device table
  (expert -> slot, or n_slots + expert when absent) on the device: no host sync, no Python
  per expert; an absent expert reads the last slot and is flagged (its code >= n_slots) for
  the pass to repair. A layer whose every expert sits in the slot numbered like it
  (cache.ids_are_slots, e.g. at a 100% budget) skips the table: its ids are its slots, baked
  into the graph, so it does so only if the pass held the layer before building (device.build_held);
  the pass holds the layer (no eviction, no trim) until it evaluated the forward. A layer the pass
  routes (runtime/decode/window_routes.py) syncs its codes before its experts run and looks up again
  when absent experts were read.
- Calls of several tokens go through metal.window_switch_glu: the dedup kernel (each
  unique expert's weights read once per window) where it runs and is self-checked,
  else the stock SwitchGLU, as single tokens do.
- What is exact: without the kernel (every non-Metal backend, unsupported layers,
  windows over KERNEL_MAX_PAIRS) the output is stock mlx-lm's, bit for bit. The kernel
  (Metal only) matches the reference within metal.dedup_verify.tolerance (rtol 1e-4
  float32, 5e-3 float16, 3e-2 bfloat16 of the output's largest magnitude), checked at
  its first use per configuration: close to, not bit-identical with, stock.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal import window_switch_glu
from runtime.cache.expert_cache import ExpertCache
from runtime.cache.expert_major import expert_major_call, wants_expert_major
from runtime.cache.slab_switch import slab_switch_glu
from storage import LayerLayout


def split_by_capacity(ids: np.ndarray, capacity: int) -> list[slice]:
    """Consecutive token ranges of `ids` (N, k) whose unique experts each fit `capacity`."""
    groups, start, seen = [], 0, set()
    for t in range(ids.shape[0]):
        row = set(ids[t].tolist())
        if len(seen | row) > capacity and t > start:
            groups.append(slice(start, t))
            start, seen = t, set()
        seen |= row
    groups.append(slice(start, ids.shape[0]))
    return groups


class CachedSwitchGLU(nn.Module):
    def __init__(self, layer: int, layout: LayerLayout, cache: ExpertCache, activation, observer=None, like=None):
        super().__init__()
        self.layer = layer
        self.cache = cache
        self.observer = observer  # if set: observer(layer, expert_ids (N, k)) on every call (the decoder's)
        self.telemetry = None  # if set: telemetry.on_call(layer, expert_ids (N, k), [CallStats per group])
        # like: the stock expert module being replaced; the slab module runs its class (runtime/cache/slab_switch.py)
        self.switch = slab_switch_glu(layout, cache.slabs[layer], activation, like=like)
        # Plain attributes, not module state (nn.Module keeps lists and arrays in its dict, behind a slower
        # lookup, and would walk them as parameters): the hit path reads them on every call.
        object.__setattr__(self, "_pending", [])  # (output, pinned slots) of synced calls not yet evaluated
        object.__setattr__(self, "_table", cache.device_tables[layer])  # persistent: updated in place
        object.__setattr__(self, "_last_slot", mx.array(cache.n_slots(layer) - 1, mx.uint32))
        object.__setattr__(self, "_switch", self.switch)

    def release(self) -> None:
        """Evaluate this module's pending outputs and unpin their slots (between generations)."""
        self.release_pending()

    def release_pending(self) -> None:
        """Evaluate this module's pending synced outputs and unpin their slots."""
        if self._pending:
            mx.eval([out for out, _ in self._pending])
            for _, slots in self._pending:
                self.cache.unpin(self.layer, slots)
            self._pending.clear()

    def _run(self, x: mx.array, ids: np.ndarray, calls: list) -> mx.array:
        unique = np.unique(ids)
        slots, stats = self.cache.ensure(self.layer, unique)
        calls.append(stats)
        try:
            slot_ids = self.cache.slot_ids(self.layer, ids)
            slot_inds = mx.array(slot_ids.astype(np.uint32))
            # Windows of several tokens (verify, prefill) read each unique expert once; decode keeps stock.
            n_tokens = slot_ids.size // slot_ids.shape[-1]
            out = window_switch_glu(self.switch, x, slot_inds) if n_tokens > 1 else self.switch(x, slot_inds)
        except BaseException:
            self.cache.unpin(self.layer, slots)
            raise
        self._pending.append((out, slots))
        return out

    def _token_call(self, x: mx.array, indices: mx.array) -> tuple[mx.array | None, np.ndarray]:
        """One token's call (a decode step), outside a device pass and unobserved: what release_pending(), ensure(),
        slot_ids() and the telemetry do for it, its unique experts found once from a list. Experts all valid: one lock
        round trip (use_valid); else ensure() reads the absent ones. Returns (output, expert ids); the output is None
        when the experts exceed the usable slots: then the earlier outputs are released, a pending resize applied
        and nothing else changed, for the general path (expert-major) to run the call."""
        pending = self._pending
        if pending:
            mx.eval([out for out, _ in pending])  # evaluated before their slots are unpinned (in use_valid)
        release = [s for _, slots in pending for s in slots]
        pending.clear()
        self.cache.unprotect(self.layer)  # the verify pass is here: forecasts of this layer have served
        ids = np.array(indices)  # host sync: which experts this call needs
        self.cache.host_syncs += 1
        row = ids.reshape(-1).tolist()
        experts = sorted(set(row))
        got = self.cache.use_valid(self.layer, experts, release)
        if got is not None:
            slots, stats = got[0], (len(experts), 0, got[1], 0, 0.0)
        elif len(experts) > self.cache.usable_slots(self.layer):
            return None, ids  # more than the slots hold: expert-major (the general path)
        else:  # absent or loading experts: read them (what _run does, its unique experts known)
            found, call = self.cache.ensure(self.layer, experts)
            slots, stats = found.tolist(), (call.hits, call.misses, call.prefetch_used, call.bytes_read, call.stall_ms)
        slot_of = dict(zip(experts, slots))
        inds = [slot_of[e] for e in row]
        for _ in range(ids.ndim - 1):
            inds = [inds]  # ids' shape: every leading dimension is 1
        try:
            out = self._switch(x, mx.array(inds, mx.uint32))
        except BaseException:
            self.cache.unpin(self.layer, slots)
            raise
        pending.append((out, slots))
        if self.telemetry is not None:  # the records on_call() files, its counts known here
            self.telemetry.on_forward([(self.layer, ids.reshape(1, -1), len(experts), stats)])
        return out, ids

    @property
    def device(self):
        """The device pass building a forward now (cache.active_pass), or None: one switch for all layers."""
        return self.cache.active_pass

    def lookup(self, x: mx.array, indices: mx.array, device=None) -> tuple[mx.array, mx.array]:
        """The call with slots looked up on the device: (output, codes: slot, or n_slots + expert if absent).
        A routed layer (runtime/decode/window_routes.py) syncs the codes first and reads absent experts."""
        if self.cache.ids_are_slots(self.layer) and (device is None or self.layer in device.build_held):
            # Every expert sits in the slot of its own number (the layer's slots hold it whole, warmed in order)
            # and the pass's hold, taken before this build, keeps it there: the ids are the slots, none absent; no
            # gather, no clamp. The slot numbers are in the graph from now on: an unheld layer looks up instead. (A
            # route sync releases the holds only after everything built so far ran, and takes them again before the
            # next layer is built.)
            codes = safe = indices
        else:
            codes = self._table[indices]
            if device is not None and self.layer in device.route_layers and device.route(self.layer, indices, codes):
                codes = self._table[indices]  # its absent experts were read: look up again
            safe = mx.minimum(codes, self._last_slot)  # absent: any slot; the pass recomputes then
        if indices.size > indices.shape[-1]:  # a window of several tokens
            return window_switch_glu(self._switch, x, safe), codes
        return self._switch(x, safe), codes

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        device = self.cache.active_pass
        if device is None and self.observer is None and indices.size == indices.shape[-1]:
            out, ids = self._token_call(x, indices)
            if out is not None:
                return out
        else:
            if self._pending:
                self.release_pending()
            if device is not None and self.layer in device.lookup_layers:
                out, slots = self.lookup(x, indices, device)
                device.record(self.layer, indices, slots)
                return out
            self.cache.unprotect(self.layer)  # the verify pass is here: forecasts of this layer have served
            ids = np.array(indices)  # host sync: which experts this call needs
            self.cache.host_syncs += 1
        if self.observer is not None and device is None:
            self.observer(self.layer, ids.reshape(-1, ids.shape[-1]))
        k = ids.shape[-1]
        flat = ids.reshape(-1, k)
        if wants_expert_major(self.cache, self.layer, flat):  # prefill: each expert read once (expert_major.py)
            out, calls = expert_major_call(self.cache, self.layer, self.switch, x, ids)
            if device is not None:
                device.record_synced(self.layer, flat, calls)
            elif self.telemetry is not None:
                self.telemetry.on_call(self.layer, flat, calls)
            return out
        groups = split_by_capacity(flat, self.cache.usable_slots(self.layer))
        calls: list = []
        if len(groups) == 1:
            out = self._run(x, ids, calls)
        else:
            lead, D = x.shape[:-1], x.shape[-1]
            xf = x.reshape(-1, D)
            outs = []
            for g in groups:
                outs.append(self._run(xf[g], flat[g], calls))
                self.release_pending()  # the next group may evict these slots
            out = mx.concatenate(outs, axis=0).reshape(*lead, k, D)
        if device is not None:
            device.record_synced(self.layer, flat, calls)  # the pass books it with the accepted forward
        elif self.telemetry is not None:
            self.telemetry.on_call(self.layer, flat, calls)
        return out
