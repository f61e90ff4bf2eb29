"""SlotTable: which expert occupies which cache slot, per layer (pure bookkeeping).

States of a slot: free, loading (reserved for a key whose bytes are being read),
valid (holds the key's bytes). Pins count readers that may still read a slot
(graphs not yet evaluated, forecasts not yet used): a pinned or loading slot is
never chosen for eviction.

Invariants: expert_to_slot and slot_to_expert are inverse on occupied slots; a
key is in at most one slot; only commit() makes a slot valid, and abort()
returns a reserved slot to free, so a failed load never leaves a valid slot.
reserve() only hands out slots below `usable`; slots at or above it (after a
shrink by the memory governor) hold at most experts still pinned or loading.
Violations (reserving a key that has a slot, committing one that is not loading,
unpinning a slot more often than it was pinned) raise RuntimeError: these checks
guard memory safety and must hold under `python -O` too.
Not thread-safe by itself: ExpertCache serialises access with its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.cache.policy import make_policy
from storage import ExpertKey

FREE, LOADING, VALID = 0, 1, 2


@dataclass
class LayerCacheStats:
    hits: int = 0  # unique experts per call found valid (or already loading for this call's reader)
    misses: int = 0  # unique experts per call that had to be read
    evictions: int = 0  # valid experts dropped to make room
    prefetch_hits: int = 0  # hits on slots a prefetch filled (or is filling) and nobody had used yet
    prefetch_loaded: int = 0  # prefetches that completed
    prefetch_wasted: int = 0  # prefetched experts evicted before any use
    prefetch_cancelled: int = 0  # prefetches dropped before their read started
    shrink_evictions: int = 0  # valid experts dropped because their slot left the usable range


class LayerSlots:
    def __init__(self, n_experts: int, n_slots: int, policy: str):
        self.n_slots = n_slots
        self.expert_to_slot = np.full(n_experts, -1, np.int32)
        self.slot_to_expert = np.full(n_slots, -1, np.int32)
        self.state = np.zeros(n_slots, np.int8)
        self.pins = np.zeros(n_slots, np.int32)
        self.prefetched = np.zeros(n_slots, bool)  # filled by a prefetch, not yet used
        self.policy = make_policy(policy, n_slots)
        self.stats = LayerCacheStats()
        self.usable = n_slots  # slots [0, usable) may be filled (memory governor shrinks it)


class SlotTable:
    def __init__(self, n_experts: dict[int, int], slots: dict[int, int], policy: str = "lru"):
        for layer, n in slots.items():
            if n < 1:
                raise ValueError(f"layer {layer}: {n} slots; at least 1 is needed")
        self.policy_name = policy
        self.layers = {layer: LayerSlots(n_experts[layer], slots[layer], policy) for layer in slots}

    def slot_of(self, key: ExpertKey) -> int:
        return int(self.layers[key.layer].expert_to_slot[key.expert])

    def state_of(self, key: ExpertKey) -> int:
        ls = self.layers[key.layer]
        slot = ls.expert_to_slot[key.expert]
        return FREE if slot < 0 else int(ls.state[slot])

    def access(self, layer: int, experts) -> tuple[list[int], list[int]]:
        """Record a use of `experts` (unique ids). Returns (present, absent) expert ids;
        present ones (valid or loading) are touched and counted as hits."""
        ls = self.layers[layer]
        present, absent = [], []
        for e in experts:
            slot = ls.expert_to_slot[e]
            if slot >= 0:
                present.append(int(e))
                ls.policy.on_access(int(slot))
                ls.stats.hits += 1
                if ls.prefetched[slot]:
                    ls.stats.prefetch_hits += 1
                    ls.prefetched[slot] = False
            else:
                absent.append(int(e))
                ls.stats.misses += 1
        return present, absent

    def request(self, layer: int, experts) -> tuple[list[int], list[int], list[int]]:
        """One call's bookkeeping, shared by the live cache and replays: record the use of
        `experts` (unique ids), pin the slots of those present, reserve and pin a slot for each
        absent one. Returns (present expert ids, absent expert ids, pinned slots), absent in the
        order reserved. Raises RuntimeError (after unpinning) if no slot can be freed."""
        ls = self.layers[layer]
        present, absent = self.access(layer, experts)
        pinned = [int(ls.expert_to_slot[e]) for e in present]
        self.pin(layer, pinned)
        for e in absent:
            slot = self.reserve(ExpertKey(layer, e))
            if slot is None:
                self.unpin(layer, pinned)
                for a in absent[: absent.index(e)]:
                    self.abort(ExpertKey(layer, a))
                raise RuntimeError(
                    f"layer {layer}: no evictable slot for expert {e} ({ls.usable} usable slots, "
                    f"{int((ls.pins > 0).sum())} pinned); a call needs at most {ls.usable} unique experts"
                )
            self.pin(layer, [slot])
            pinned.append(slot)
        return present, absent, pinned

    def reserve(self, key: ExpertKey, *, prefetch: bool = False) -> int | None:
        """Give `key` a slot in state loading, evicting if needed; None if every slot is busy."""
        ls = self.layers[key.layer]
        if ls.expert_to_slot[key.expert] >= 0:
            raise RuntimeError(f"reserve({key}): the expert already has slot {int(ls.expert_to_slot[key.expert])}")
        free = [s for s in range(ls.usable) if ls.state[s] == FREE]
        if free:
            slot = free[0]
        else:
            candidates = [s for s in range(ls.usable) if ls.state[s] == VALID and ls.pins[s] == 0]
            if not candidates:
                return None
            slot = ls.policy.victim(candidates)
            ls.expert_to_slot[ls.slot_to_expert[slot]] = -1
            ls.stats.evictions += 1
            if ls.prefetched[slot]:
                ls.stats.prefetch_wasted += 1
        ls.slot_to_expert[slot] = key.expert
        ls.expert_to_slot[key.expert] = slot
        ls.state[slot] = LOADING
        ls.prefetched[slot] = prefetch
        ls.policy.on_insert(slot, key.expert, prefetch)
        return slot

    def commit(self, key: ExpertKey) -> None:
        ls = self.layers[key.layer]
        slot = ls.expert_to_slot[key.expert]
        if slot < 0 or ls.state[slot] != LOADING:
            raise RuntimeError(f"commit({key}): the expert is not loading (slot {int(slot)})")
        ls.state[slot] = VALID
        if ls.prefetched[slot]:
            ls.stats.prefetch_loaded += 1

    def abort(self, key: ExpertKey, *, cancelled: bool = False) -> None:
        ls = self.layers[key.layer]
        slot = ls.expert_to_slot[key.expert]
        if slot < 0:
            return
        if cancelled and ls.prefetched[slot]:
            ls.stats.prefetch_cancelled += 1
        ls.expert_to_slot[key.expert] = -1
        ls.slot_to_expert[slot] = -1
        ls.state[slot] = FREE
        ls.prefetched[slot] = False

    def pin(self, layer: int, slots) -> None:
        np.add.at(self.layers[layer].pins, np.asarray(slots, np.int64), 1)

    def unpin(self, layer: int, slots) -> None:
        pins = self.layers[layer].pins
        slots = np.asarray(slots, np.int64)
        after = pins.copy()
        np.subtract.at(after, slots, 1)
        if (after < 0).any():
            raise RuntimeError(f"layer {layer}: unpin of slot(s) {np.flatnonzero(after < 0).tolist()} that were not pinned")
        pins[:] = after

    def set_usable(self, layer: int, n: int) -> int:
        """Allow only slots [0, n) to be filled from now on. Valid, unpinned experts in
        slots >= n are evicted now; pinned or loading ones stay until trim() after their
        release. Returns how many were evicted."""
        ls = self.layers[layer]
        if not 1 <= n <= ls.n_slots:
            raise ValueError(f"layer {layer}: usable slots {n} outside 1..{ls.n_slots}")
        ls.usable = n
        return self.trim(layer)

    def trim(self, layer: int) -> int:
        """Evict valid, unpinned experts living in slots >= usable; returns how many."""
        ls = self.layers[layer]
        beyond = np.arange(ls.usable, ls.n_slots)
        gone = beyond[(ls.state[beyond] == VALID) & (ls.pins[beyond] == 0)]
        for slot in gone:
            ls.expert_to_slot[ls.slot_to_expert[slot]] = -1
            ls.slot_to_expert[slot] = -1
            ls.state[slot] = FREE
            if ls.prefetched[slot]:
                ls.stats.prefetch_wasted += 1
            ls.prefetched[slot] = False
        ls.stats.shrink_evictions += len(gone)
        return len(gone)

    def clear(self, layer: int) -> None:
        """Forget every expert of `layer`, as freshly built (stats are kept). Raises if a slot
        is pinned or loading: its reader or its read still needs it."""
        ls = self.layers[layer]
        if (ls.pins > 0).any() or (ls.state == LOADING).any():
            raise RuntimeError(f"layer {layer}: cannot clear while slots are pinned or loading")
        ls.expert_to_slot[:] = -1
        ls.slot_to_expert[:] = -1
        ls.state[:] = FREE
        ls.prefetched[:] = False
        ls.policy = make_policy(self.policy_name, ls.n_slots)

    def valid_count(self, layer: int) -> int:
        return int((self.layers[layer].state == VALID).sum())
