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
`resident` is the device lookup code of each expert: its slot if valid, else the absent
code n_slots + expert (so a lookup both finds the slot and, being >= n_slots, flags the
absence and names the expert). It changes when a load commits (absent -> slot) and when an
expert is evicted or dropped (slot -> absent), never otherwise, so ExpertCache can hand it to
the device as the lookup table of lazily built forwards. While a layer is held (a forward
that looks slots up on the device is pending), no valid expert of it is evicted or trimmed:
reserve() only takes free slots. `version` changes with every change of a layer's lookup codes or
usable range (a shrink whose trim waits for a hold too), so an answer cached on it is never stale.
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
    def __init__(self, n_experts: int, n_slots: int, policy: str, resident: np.ndarray | None = None):
        self.n_slots = n_slots
        # device lookup codes: slot of a valid expert, else n_slots + expert; may be a view of a device array
        self.resident = self.absent_codes(n_experts, n_slots) if resident is None else resident
        self.held = 0  # pending device-lookup forwards reading this layer: no valid slot may be evicted
        self.expert_to_slot = np.full(n_experts, -1, np.int32)
        self.slot_to_expert = np.full(n_slots, -1, np.int32)
        self.state = np.zeros(n_slots, np.int8)
        self.pins = np.zeros(n_slots, np.int32)
        self.prefetched = np.zeros(n_slots, bool)  # filled by a prefetch, not yet used
        self.ever_prefetched = False  # any prefetch reserved here yet (lets record_use skip the flags)
        self.policy = make_policy(policy, n_slots)
        self.stats = LayerCacheStats()
        self.usable = n_slots  # slots [0, usable) may be filled (memory governor shrinks it)

    @staticmethod
    def absent_codes(n_experts: int, n_slots: int) -> np.ndarray:
        return (n_slots + np.arange(n_experts)).astype(np.uint32)

    def is_absent(self, experts) -> np.ndarray:
        """Per expert: no valid slot (what a device lookup flags)."""
        return self.resident[experts] >= self.n_slots

    def not_holding(self, experts: np.ndarray) -> np.ndarray:
        """Per usable slot: it holds (valid or loading) none of `experts`. From expert_to_slot, the inverse of
        slot_to_expert for every slot that holds an expert: ~2 us where np.isin over the owners took ~20-40."""
        mask = np.ones(self.usable, bool)
        slots = self.expert_to_slot[experts]
        mask[slots[(slots >= 0) & (slots < self.usable)]] = False
        return mask


class SlotTable:
    def __init__(self, n_experts: dict[int, int], slots: dict[int, int], policy: str = "lru", resident=None):
        """`resident(layer, codes)`, if given, returns an array holding `codes` (uint32, all absent) to keep
        each layer's lookup codes in (ExpertCache passes views of device arrays)."""
        for layer, n in slots.items():
            if n < 1:
                raise ValueError(f"layer {layer}: {n} slots; at least 1 is needed")
        self.policy_name = policy
        self.evictions = 0  # experts dropped from a valid slot, all layers (evict, trim, clear): while it is
        # unchanged, every expert keeps the slot it had (record_slots() may take slots read earlier as current)
        self.version = 0  # changes whenever any layer's lookup codes (`resident`) or usable range change
        self.layers = {layer: LayerSlots(n_experts[layer], slots[layer], policy, None if resident is None else
                                         resident(layer, LayerSlots.absent_codes(n_experts[layer], slots[layer])))
                       for layer in slots}

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

    def use_valid(self, layer: int, experts: list[int]) -> tuple[list[int], int] | None:
        """request() of `experts` (unique ids, in order) when every one is valid: recency, hits and prefetch use as
        access() books them, their slots pinned. Returns (slots, prefetch hits), or None, changing nothing, when one
        is not valid (request() then reads it). A decode token's call, all hits: a few list operations."""
        ls = self.layers[layer]
        to_slot, state = ls.expert_to_slot, ls.state
        slots = [int(to_slot[e]) for e in experts]
        for s in slots:
            if s < 0 or state[s] != VALID:
                return None
        used = self.record_slots(layer, slots, None, len(slots), 0)[1]
        self.pin(layer, slots)
        return slots, used

    def reserve(self, key: ExpertKey, *, prefetch: bool = False) -> int | None:
        """Give `key` a slot in state loading, evicting if needed; None if every slot is busy."""
        ls = self.layers[key.layer]
        if ls.expert_to_slot[key.expert] >= 0:
            raise RuntimeError(f"reserve({key}): the expert already has slot {int(ls.expert_to_slot[key.expert])}")
        state = ls.state[: ls.usable]
        free = np.flatnonzero(state == FREE)
        if len(free):
            slot = int(free[0])
        else:
            if ls.held:
                return None  # a pending forward may read any valid slot of this layer
            candidates = np.flatnonzero((state == VALID) & (ls.pins[: ls.usable] == 0)).tolist()
            if not candidates:
                return None
            slot = ls.policy.victim(candidates)
            old = ls.slot_to_expert[slot]
            ls.expert_to_slot[old] = -1
            ls.resident[old] = ls.n_slots + old
            ls.stats.evictions += 1
            self.evictions += 1
            self.version += 1
            if ls.prefetched[slot]:
                ls.stats.prefetch_wasted += 1
        ls.slot_to_expert[slot] = key.expert
        ls.expert_to_slot[key.expert] = slot
        ls.state[slot] = LOADING
        ls.prefetched[slot] = prefetch
        ls.ever_prefetched |= prefetch
        ls.policy.on_insert(slot, key.expert, prefetch)
        return slot

    def commit(self, key: ExpertKey) -> None:
        ls = self.layers[key.layer]
        slot = ls.expert_to_slot[key.expert]
        if slot < 0 or ls.state[slot] != LOADING:
            raise RuntimeError(f"commit({key}): the expert is not loading (slot {int(slot)})")
        ls.state[slot] = VALID
        ls.resident[key.expert] = slot
        self.version += 1
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
        ls.resident[key.expert] = ls.n_slots + key.expert
        self.version += 1
        ls.slot_to_expert[slot] = -1
        ls.state[slot] = FREE
        ls.prefetched[slot] = False

    # pin/unpin take a few slots per call, many times per token: a loop over Python ints costs ~0.2 us a slot,
    # np.add.at / np.subtract.at ~20-40 us a call whatever the size.
    def pin(self, layer: int, slots) -> None:
        pins = self.layers[layer].pins
        for s in _ints(slots):
            pins[s] += 1

    def unpin(self, layer: int, slots) -> None:
        """Release one pin per listed slot (a slot listed twice, twice); raises, changing nothing, if a slot
        would go below zero."""
        pins = self.layers[layer].pins
        slots = _ints(slots)
        for i, s in enumerate(slots):
            if pins[s] <= 0:
                for r in slots[:i]:
                    pins[r] += 1
                bad = sorted({t for t in slots if slots.count(t) > pins[t]})  # pins are as before the call
                raise RuntimeError(f"layer {layer}: unpin of slot(s) {bad} that were not pinned")
            pins[s] -= 1

    def set_usable(self, layer: int, n: int) -> int:
        """Allow only slots [0, n) to be filled from now on. Valid, unpinned experts in
        slots >= n are evicted now; pinned or loading ones stay until trim() after their
        release. Returns how many were evicted."""
        ls = self.layers[layer]
        if not 1 <= n <= ls.n_slots:
            raise ValueError(f"layer {layer}: usable slots {n} outside 1..{ls.n_slots}")
        if n != ls.usable:
            self.version += 1  # cached answers that depend on the usable range (ids_are_slots) are stale now
        ls.usable = n
        return self.trim(layer)

    def trim(self, layer: int) -> int:
        """Evict valid, unpinned experts living in slots >= usable; returns how many."""
        ls = self.layers[layer]
        if ls.held:
            return 0  # a pending forward may read them; trimmed at the next settle
        beyond = np.arange(ls.usable, ls.n_slots)
        gone = beyond[(ls.state[beyond] == VALID) & (ls.pins[beyond] == 0)]
        for slot in gone:
            old = ls.slot_to_expert[slot]
            ls.expert_to_slot[old] = -1
            ls.resident[old] = ls.n_slots + old
            ls.slot_to_expert[slot] = -1
            ls.state[slot] = FREE
            if ls.prefetched[slot]:
                ls.stats.prefetch_wasted += 1
            ls.prefetched[slot] = False
        ls.stats.shrink_evictions += len(gone)
        self.evictions += len(gone)
        self.version += len(gone)
        return len(gone)

    def clear(self, layer: int) -> None:
        """Forget every expert of `layer`, as freshly built (stats are kept). Raises if a slot
        is pinned or loading: its reader or its read still needs it."""
        ls = self.layers[layer]
        if (ls.pins > 0).any() or (ls.state == LOADING).any() or ls.held:
            raise RuntimeError(f"layer {layer}: cannot clear while slots are pinned or loading")
        self.evictions += 1
        self.version += 1
        ls.expert_to_slot[:] = -1
        ls.slot_to_expert[:] = -1
        ls.state[:] = FREE
        ls.prefetched[:] = False
        ls.resident[:] = LayerSlots.absent_codes(len(ls.resident), ls.n_slots)  # in place: it is the device table
        ls.policy = make_policy(self.policy_name, ls.n_slots)

    def record_use(self, layer: int, experts: np.ndarray, loaded: int = 0, reads: int | None = None) -> tuple[int, int]:
        """The bookkeeping of a call whose unique `experts` were all valid when it ran, `loaded` of them
        read for it on demand, out of `reads` demand reads made for it (default `loaded`; a repair may
        read experts the recomputed call did not use: they count as misses too, as their bytes were
        read): recency, hits/misses, prefetch use. Returns (hits, prefetch hits).
        Runs once per layer per token on a handful of ids: two numpy ops, no per-expert numpy."""
        slots = self.layers[layer].expert_to_slot[experts]
        return self.record_slots(layer, slots.tolist(), slots, len(experts) - loaded, loaded if reads is None else reads)

    def record_slots(self, layer: int, slots: list, array: np.ndarray | None, hits: int, misses: int) -> tuple[int, int]:
        """record_use() given the experts' slots (a list; `array`: the same as an int array, or None), `hits`
        and `misses` to count: recency and prefetch use. A slot < 0 (evicted since the call ran) is skipped."""
        ls = self.layers[layer]
        many = getattr(ls.policy, "on_access_many", None)  # a policy's batch form, where it has one
        if many is not None:
            many([s for s in slots if s >= 0] if min(slots, default=0) < 0 else slots)
        else:
            on_access = ls.policy.on_access
            for slot in slots:
                if slot >= 0:
                    on_access(slot)
        used = 0
        if ls.ever_prefetched:
            array = np.asarray(slots, np.int64) if array is None else array
            flags = ls.prefetched[array]
            if flags.any():
                hit = array[flags & (array >= 0)]
                ls.prefetched[hit] = False
                used = len(hit)
        st = ls.stats
        st.hits += hits
        st.misses += misses
        st.prefetch_hits += used
        return hits, used

    def valid_count(self, layer: int) -> int:
        return int((self.layers[layer].state == VALID).sum())


def _ints(slots) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else [int(s) for s in slots]
