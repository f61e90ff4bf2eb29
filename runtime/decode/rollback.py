"""Rolling a prompt cache back over the last positions a forward wrote.

Trimmable caches (KVCache) drop positions; those that cannot be trimmed (GatedDeltaNet's
ArraysCache, a full rotating cache) are restored from a snapshot taken before the forward.

Invariant: after roll_back(cache, snapshot, n, start), caches [start:stop] hold what they
held when the snapshot was taken, provided exactly n positions were written since; the other
caches are untouched.
"""

from __future__ import annotations

from mlx.utils import tree_map


def snapshot_untrimmable(cache) -> list:
    """States of the caches that cannot be trimmed (containers copied, arrays shared); None for the rest."""
    return [None if c.is_trimmable() else tree_map(lambda x: x, c.state) for c in cache]


def roll_back(cache, snapshot: list, n: int, start: int = 0, stop: int | None = None) -> None:
    """Drop the last n positions written to caches [start:stop]: trim, or restore a copy of the snapshot
    (a copy because caches mutate their state containers in place, and a snapshot may serve twice)."""
    for c, s in list(zip(cache, snapshot))[start:stop]:
        if s is None:
            c.trim(n)
        else:
            c.state = tree_map(lambda x: x, s)
