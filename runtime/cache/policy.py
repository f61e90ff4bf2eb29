"""Eviction policies for one layer's slots, behind one small interface.

A policy only ranks slots; it never decides what is evictable (pins and
in-flight loads are the SlotTable's business). Policies are pure Python so the
live cache and offline replays (cache sweeps) run the very same code.

The SlotTable tells a policy which expert a slot now holds and whether a prefetch
(not a use) brought it in; policies that keep history per expert use that.
"""

from __future__ import annotations

from typing import Protocol

from runtime.cache.decayed_lfu import DecayedLFUPolicy


class EvictionPolicy(Protocol):
    def on_insert(self, slot: int, expert: int = -1, prefetch: bool = False) -> None:
        """`expert` now lives in `slot` (the previous occupant, if any, is gone); `prefetch`: a
        forecast brought it in, nobody has used it yet."""

    def on_access(self, slot: int) -> None:
        """The expert in `slot` was used."""

    def victim(self, candidates: list[int]) -> int:
        """Pick the slot to evict among `candidates` (non-empty)."""


class LRUPolicy:
    """Evict the slot used longest ago."""

    name = "lru"

    def __init__(self, n_slots: int):
        self._tick = 0
        self._last = [0] * n_slots

    def on_insert(self, slot: int, expert: int = -1, prefetch: bool = False) -> None:
        self.on_access(slot)

    def on_access(self, slot: int) -> None:
        self._tick += 1
        self._last[slot] = self._tick

    def victim(self, candidates: list[int]) -> int:
        return min(candidates, key=self._last.__getitem__)


class LFUAgingPolicy:
    """Evict the least frequently used slot; counts halve every `period` accesses
    so that experts popular long ago do not stay forever. Ties go to LRU."""

    name = "lfu"

    def __init__(self, n_slots: int, period: int | None = None):
        self._period = period or max(64, 8 * n_slots)
        self._count = [0.0] * n_slots
        self._last = [0] * n_slots
        self._tick = 0

    def on_insert(self, slot: int, expert: int = -1, prefetch: bool = False) -> None:
        self._count[slot] = 0.0
        self.on_access(slot)

    def on_access(self, slot: int) -> None:
        self._tick += 1
        self._count[slot] += 1.0
        self._last[slot] = self._tick
        if self._tick % self._period == 0:
            self._count = [c / 2 for c in self._count]

    def victim(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda s: (self._count[s], self._last[s]))


POLICIES = {"lru": LRUPolicy, "lfu": LFUAgingPolicy, "dlfu": DecayedLFUPolicy}
DEFAULT_POLICY = "dlfu"  # chosen by replaying the embedded pair's traces (docs/read-less.md)


def make_policy(name: str, n_slots: int) -> EvictionPolicy:
    try:
        return POLICIES[name](n_slots)
    except KeyError:
        raise ValueError(f"cache policy {name!r}; expected one of {sorted(POLICIES)}") from None
