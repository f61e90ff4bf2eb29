"""roll_back/snapshot_untrimmable (runtime/decode/rollback.py): a full sliding-window cache, which writes into
its arrays in place, comes back exactly as snapshotted, also after two forwards wrote and twice in a row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from runtime.decode.rollback import roll_back, snapshot_untrimmable


def _write(c, value: float) -> None:
    kv = mx.full((1, 1, 1, 2), value)
    c.update_and_fetch(kv, kv)
    mx.eval(c.keys)


def test_a_full_window_comes_back_after_writes_that_overwrote_its_oldest_positions():
    c = RotatingKVCache(max_size=4)
    for v in range(6):  # full: the window wraps, the cache cannot be trimmed
        _write(c, v)
    assert not c.is_trimmable()
    before = np.array(c.keys), c.offset, c._idx
    snap = snapshot_untrimmable([c])
    for serve in range(2):  # a snapshot may serve twice (a repair, then another)
        _write(c, 100 + serve)
        _write(c, 200 + serve)  # a second forward (built early, then dropped) overwrites another live position
        roll_back([c], snap, 2)
        assert np.array_equal(np.array(c.keys), before[0]) and (c.offset, c._idx) == before[1:]
