"""ResidentTables: the part of ExpertCache that serves forwards looking slots up on the device.

Each MoE layer has one persistent uint32 device array, expert -> slot if valid, else the absent
code n_slots + expert, whose memory is the SlotTable's `resident` map: a commit writes one
entry (absent -> slot), an eviction writes one (slot -> absent), and nothing is ever rebuilt or
uploaded per step. A forward maps its router's ids through it on the device (codes >= n_slots
flag the absent experts); the host learns which experts were
absent at the forward's one sync, reads them all at once (load_absent) and the decoder
recomputes from the first layer that missed (runtime/decode/device_pass.py). A layer whose every
expert is valid in the slot numbered like it (ids_are_slots: a whole layer warmed in order) needs no
lookup at all: its codes are the router's ids.

Invariants:
- No slot a pending (not yet evaluated) device-lookup graph may read is overwritten: the
  decoder hold()s a layer before it builds a graph that takes the layer's ids as slots (the slot
  numbers are in the graph from then on), before it queues any other graph reading it, and
  release()s after that graph's sync; while held, a layer's valid experts are neither evicted
  (reserve() takes only free slots) nor trimmed by a shrink. A commit during a hold only turns an
  absent code into a slot whose bytes are written.
- ids_are_slots() is cached on the SlotTable's version, which changes with every lookup code and
  every usable range (a shrink whose trim waits for a hold included): never a stale answer.
- load_absent() returns only when every requested expert is valid, or raises, and leaves
  nothing pinned either way. It records no hits or misses: record_forward() does, once per
  forward, after the forward has been accepted.
"""

from __future__ import annotations

import time

import numpy as np

from runtime.cache.slot_table import FREE, LOADING, VALID
from storage import ExpertKey
from storage.loader import DEMAND, PREFETCH


class ResidentTables:
    """Mixin of ExpertCache (uses its lock, SlotTable, loader and tickets)."""

    def hold(self, layers=None) -> None:
        """A device-lookup forward reading `layers` (None: all) is about to be built: no valid slot
        of them may be evicted until release(layers)."""
        with self._lock:
            for layer in self.table.layers if layers is None else layers:
                self.table.layers[layer].held += 1

    def release(self, layers=None) -> None:
        """The held forward was evaluated: evictions (and pending trims of shrunk layers) may resume."""
        with self._lock:
            for layer in list(self.table.layers if layers is None else layers):
                ls = self.table.layers[layer]
                if ls.held <= 0:
                    raise RuntimeError(f"layer {layer}: release() without a matching hold()")
                ls.held -= 1
                if not ls.held:
                    self._settle_beyond(layer)

    def ids_are_slots(self, layer: int) -> bool:
        """Whether every expert of `layer` is valid in the slot numbered like it (lookup codes == expert ids,
        as a warm start leaves a layer whose slots hold all its experts): a device lookup may then use the
        router's ids as slots, none absent. Recomputed only when some lookup code or usable range changed. A caller
        that builds a graph on this answer holds the layer first (the hold keeps the answer true until release)."""
        with self._lock:
            if self._ids_are_slots[0] != self.table.version:
                self._ids_are_slots = (self.table.version, frozenset(
                    l for l, ls in self.table.layers.items()  # fewer usable slots than experts: never (and cheap)
                    if ls.usable >= len(ls.resident)
                    and np.array_equal(ls.resident, np.arange(len(ls.resident), dtype=ls.resident.dtype))))
            return layer in self._ids_are_slots[1]

    def is_held(self) -> bool:
        with self._lock:
            return any(ls.held for ls in self.table.layers.values())

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Those of `experts` with no valid slot now (the host view of the device table)."""
        return experts[self.table.layers[layer].is_absent(experts)]

    def load_absent(self, needs: dict[int, np.ndarray]) -> dict[int, tuple[np.ndarray, int, float]]:
        """Make every expert of needs[layer] (unique ids, at most the layer's usable slots) valid,
        reading all absent ones in parallel; experts of the same layer never evict each other.
        Returns layer -> (experts read, bytes read, ms waited). Raises (nothing pinned) if a read
        fails or a layer has no room. Forecast experts stay protected unless a layer has no other
        room (a later layer's flagged experts may come from a wrong input; the forecast may be right)."""
        tickets, pinned, out, reserved = [], {}, {}, []
        try:
            for layer, experts in needs.items():
                experts = np.asarray(experts, np.int64)
                unprotected, waits = False, 0
                while True:
                    with self._lock:
                        ls = self.table.layers[layer]
                        if ls.held:
                            raise RuntimeError(f"layer {layer}: load_absent() while a device-lookup forward is pending")
                        read = experts[ls.expert_to_slot[experts] < 0]
                        if len(read) <= self._room(layer, experts):
                            out[layer] = read
                            self._pin_and_read(layer, experts, read, tickets, reserved, pinned.setdefault(layer, []))
                            break
                    # Short of room (rare: the room is counted once on the common path). In-flight prefetches
                    # occupying it finish first; then forecasts pinning it are let go; then there is none.
                    if waits < 4 and self._await_room(layer, experts):  # bounded: prefetches may keep arriving
                        waits += 1
                        continue
                    if not unprotected and any(k.layer == layer for k in list(self._protected)):
                        self.unprotect(layer)  # the forecasts pin the only room left: the forward is past them
                        unprotected = True
                        continue
                    raise RuntimeError(
                        f"layer {layer}: no room for experts {read.tolist()} ({ls.usable} usable slots, "
                        f"{int((ls.pins > 0).sum())} pinned; {self._slot_summary(layer, experts)}); a forward needs "
                        f"at most {ls.usable} unique experts")
            t0 = time.perf_counter()
            self._wait_reads(tickets)  # follows a failed prefetch to its demand re-read
            ms = (time.perf_counter() - t0) * 1e3 if tickets else 0.0
            with self._lock:
                for layer, experts in needs.items():
                    if self.table.layers[layer].is_absent(np.asarray(experts, np.int64)).any():
                        raise RuntimeError(f"layer {layer}: load_absent() left an expert absent")
            return {l: (r, len(r) * self.layouts[l].expert_bytes, ms) for l, r in out.items()}
        except BaseException:
            self.loader.wake()  # a read queued for this call to run, which it will not wait for now
            with self._lock:
                for key in reserved:
                    if key not in self._tickets and self.table.state_of(key) == LOADING:
                        self.table.abort(key)  # reserved, but its read was never queued
            raise
        finally:
            with self._lock:
                for layer, slots in pinned.items():
                    self.table.unpin(layer, slots)
                    self._settle_beyond(layer)

    def warm(self, keys) -> int:
        """Queue reads of the absent `keys` (each layer's first ones first) into free or evictable slots,
        at prefetch priority and unprotected: a warm start before decoding. Returns the reads queued;
        a layer whose slots are all busy takes no more."""
        queued = 0
        with self._lock:
            for key in keys:
                if self.table.slot_of(key) >= 0:
                    continue
                slot = self.table.reserve(key)
                if slot is None:
                    continue
                try:
                    self._submit(key, slot, priority=PREFETCH + key.layer)
                except BaseException:
                    self.table.abort(key)  # its read was never queued
                    raise
                queued += 1
        return queued

    def _slot_summary(self, layer: int, experts: np.ndarray) -> str:
        """What a layer's usable slots hold, for a no-room error: free, loading (and how many of those have a read
        this cache can wait for), valid (and how many of those hold one of `experts`)."""
        with self._lock:
            ls = self.table.layers[layer]
            state, owner = ls.state[: ls.usable], ls.slot_to_expert[: ls.usable]
            loading = np.flatnonzero(state == LOADING)
            waitable = sum(ExpertKey(layer, int(owner[s])) in self._tickets for s in loading)
            valid = state == VALID
            needed = int((valid & ~ls.not_holding(experts)).sum())
            return (f"{int((state == FREE).sum())} free, {len(loading)} loading ({waitable} with a read queued), "
                    f"{int(valid.sum())} valid ({needed} of them needed)")

    def _room(self, layer: int, experts: np.ndarray) -> int:
        """Slots a load for `experts` may take now (lock held): free, or valid, unpinned and not needed."""
        ls = self.table.layers[layer]
        state, pins = ls.state[: ls.usable], ls.pins[: ls.usable]
        return int(((state == FREE) | ((state == VALID) & (pins == 0) & ls.not_holding(experts))).sum())

    def _pin_and_read(self, layer: int, experts: np.ndarray, read: np.ndarray, tickets: list, reserved: list,
                      pinned: list) -> None:
        """Pin the slots of `experts` present (waiting on in-flight reads of them), reserve, pin and queue
        a demand read for each of `read` (lock held; room checked); every slot pinned goes to `pinned`."""
        ls = self.table.layers[layer]
        slots = ls.expert_to_slot[experts]
        present = slots[slots >= 0].tolist()
        self.table.pin(layer, present)
        pinned.extend(present)
        for e, slot in zip(experts[slots >= 0].tolist(), present):
            if ls.state[slot] == LOADING:  # an in-flight prefetch: wait for its own read
                key = ExpertKey(layer, e)
                ticket = self._tickets.get(key) or self._submit(key, slot, priority=DEMAND)
                self.loader.promote(ticket)
                tickets.append(ticket)
        for e in read.tolist():
            key = ExpertKey(layer, e)
            slot = self.table.reserve(key)
            if slot is None:
                raise RuntimeError(f"layer {layer}: no evictable slot for expert {e} although room was counted")
            self.table.pin(layer, [slot])
            pinned.append(slot)
            reserved.append(key)
            # The caller reads the first itself (load_absent waits next); each further one wakes an I/O thread.
            tickets.append(self._submit(key, slot, priority=DEMAND, wake=bool(tickets)))

    def record_forward(self, calls: list) -> list[tuple]:
        """Bookkeeping of one accepted forward, [(layer, unique expert ids, loaded, reads, bytes read, ms
        waited)]: each call's experts were all valid when it ran, `loaded` of them read for it out of
        `reads` demand reads (a repair may read experts the recomputed call did not use; they count as
        misses). Recency, hits, misses and prefetch use as ensure() records them, under one lock round
        trip. Returns per call (hits, misses, prefetch_used, bytes_read, stall_ms), CallStats' fields."""
        out = []
        with self._lock:
            for layer, experts, loaded, reads, nbytes, ms in calls:
                hits, prefetch_used = self.table.record_use(layer, experts, loaded, reads)
                out.append((hits, reads, prefetch_used, nbytes, ms))
        return out

    def eviction_mark(self) -> int:
        """Changes whenever an expert of any layer loses its slot (record_hit_forward() relies on it)."""
        return self.table.evictions

    def record_hit_forward(self, layers: list, slots: list, mark: int) -> list[int] | None:
        """record_forward() of an accepted one-token forward whose calls all hit: slots[i] is the list of
        the k (distinct) slots layer layers[i] looked up. The slots stand for the experts only while no
        expert lost its slot since `mark` (eviction_mark() at the forward's sync): else None, and the
        caller books the expert ids with record_forward(). Returns prefetch_used per layer."""
        with self._lock:
            if self.table.evictions != mark:
                return None
            record = self.table.record_slots
            return [record(layer, s, None, len(s), 0)[1] for layer, s in zip(layers, slots)]
