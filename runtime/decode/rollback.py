"""Rolling a prompt cache back over the last positions a forward wrote.

Trimmable caches (KVCache) drop positions; those that cannot be trimmed (GatedDeltaNet's
ArraysCache, a full rotating cache) are restored from a snapshot taken before the forward.

Invariant: after roll_back(cache, snapshot, n, start), caches [start:stop] hold what they
held when the snapshot was taken, provided exactly n positions were written since (for untrimmable
caches: whatever was written since, including by forwards that were later dropped); the other
caches are untouched. After roll_back_to(cache, marks(cache, snapshot)), every cache holds what it held
at marks(), however many positions each was written since (a forward whose build raised midway wrote
only its first layers').
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map


def snapshot_untrimmable(cache) -> list:
    """States of the caches that cannot be trimmed; None for the rest. Containers are copied and every array
    is a new handle on the same data: a rotating cache writes into its arrays in place (`keys[..., i, :] = k`
    rebinds that Python object), which would otherwise change the snapshot too. With a handle kept, MLX
    copies a full window's buffer on that write instead of updating it in place (one window per sliding
    layer and token; GatedDeltaNet's states are replaced, never written in place, and cost nothing)."""
    return [None if c.is_trimmable() else tree_map(_handle, c.state) for c in cache]


def _handle(x):
    return mx.array(x) if isinstance(x, mx.array) else x


def roll_back(cache, snapshot: list, n: int, start: int = 0, stop: int | None = None) -> None:
    """Drop the last n positions written to caches [start:stop]: trim, or restore a copy of the snapshot
    (containers and handles: caches mutate both in place, and a snapshot may serve twice)."""
    for c, s in list(zip(cache, snapshot))[start:stop]:
        if s is None:
            c.trim(n)
        else:
            c.state = tree_map(_handle, s)  # new handles: the cache's in-place writes must not reach the snapshot


def marks(cache, snapshot: list) -> list:
    """Where each cache stands now, for roll_back_to(): a trimmable cache's offset; else its state (the snapshot
    from snapshot_untrimmable(), or one taken here for a trimmable cache without a single offset, a CacheList)."""
    out = []
    for c, s in zip(cache, snapshot):
        offset = getattr(c, "offset", None)
        if s is not None:
            out.append(s)
        elif isinstance(offset, int):
            out.append(offset)
        else:
            out.append(tree_map(_handle, c.state))
    return out


def roll_back_to(cache, marks: list) -> None:
    """Undo every write since marks(), layer by layer: a trimmable cache is trimmed back to its offset (by
    nothing if it was not written), any other restored from its state."""
    for c, m in zip(cache, marks):
        if isinstance(m, int):
            if c.offset > m:
                c.trim(c.offset - m)
        else:
            c.state = tree_map(_handle, m)
