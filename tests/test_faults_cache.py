"""The loader and the expert cache under injected disk faults: short reads retried, permanent
faults leave no valid slot, a prefetch being committed is never read twice, and a demand call
waits for prefetches still in flight rather than failing for want of a slot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from runtime.cache.expert_cache import ExpertCache
from runtime.cache.slot_table import VALID
from tests.conftest import GatedReader, expert_views as _views
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig, StoreError
from storage.faults import FaultyReader
from storage.reader import RangeReader
from tests.test_faults import _bytes, _clean

# -- the loader and the cache under faults ---------------------------------------------------
def test_loader_retries_a_short_read_instead_of_committing_it(tiny_dirs):
    store = ExpertStore.open(tiny_dirs["qwen3_moe"])  # raw: no CRC would catch the garbage
    reader = FaultyReader(RangeReader(), "short:times=1", store)
    loader = AsyncLoader(store, LoaderConfig(threads=1, retry_backoff_ms=0.1), reader=reader)
    key = ExpertKey(store.moe_layers[0], 7)
    views = _views(store, key.layer)
    loader.wait_all([loader.submit(key, views)])
    assert _bytes(views) == _clean(store, key) and loader.stats.n_retries == 1
    loader.close()


@pytest.mark.parametrize("spec,verify,match", [
    ("eio", False, "failed after 4 attempts"),
    ("eintr", False, "failed after 4 attempts"),
    ("short", False, "short read"),
    ("flip", True, "checksum mismatch"),
])
def test_permanent_faults_leave_no_valid_slot_on_demand_or_prefetch(packed_dirs, spec, verify, match):
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layer = store.moe_layers[0]
    reader = FaultyReader(RangeReader(), f"{spec}:layer={layer},expert=5", store)
    loader = AsyncLoader(store, LoaderConfig(threads=2, verify_checksums=verify, retry_backoff_ms=0.1), reader=reader)
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    ls = cache.table.layers[layer]
    with pytest.raises(StoreError, match=match):
        cache.ensure(layer, np.array([1, 5]))
    assert cache.table.state_of(ExpertKey(layer, 5)) != VALID and (ls.pins == 0).all()
    cache.prefetch([ExpertKey(layer, 5), ExpertKey(layer, 6)], round_id=1)
    loader.drain()
    assert cache.table.state_of(ExpertKey(layer, 5)) != VALID and cache.table.state_of(ExpertKey(layer, 6)) == VALID
    cache.unprotect()
    assert (ls.pins == 0).all()
    slots, _ = cache.ensure(layer, np.array([1, 2, 3]))  # healthy experts still load
    for e, s in zip([1, 2, 3], slots):
        assert _bytes(cache.slot_views(layer, int(s))) == _clean(store, ExpertKey(layer, e))
    cache.unpin(layer, slots)
    loader.close()


def test_a_prefetch_being_committed_is_never_read_twice(packed_dirs):
    """A demand for an expert whose prefetch read finished but whose commit is pending
    must wait for that ticket: a second read would re-commit the slot (and, before the
    fix, killed the I/O thread on an assertion)."""
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layer = store.moe_layers[0]
    loader = AsyncLoader(store, LoaderConfig(threads=1))
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    gate, entered = threading.Event(), threading.Event()
    real_on_done = cache._on_done

    def held_on_done(ticket):
        entered.set()
        gate.wait(5)
        real_on_done(ticket)

    cache._on_done = held_on_done
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)
    try:
        cache.prefetch([ExpertKey(layer, 3)], round_id=1)
        assert entered.wait(5)  # the read is done; its commit waits for the gate
        cache.unprotect()
        threading.Timer(0.05, gate.set).start()
        slots, _ = cache.ensure(layer, np.array([3]))
        cache.unpin(layer, slots)
        loader.drain()
    finally:
        threading.excepthook = old_hook
        gate.set()
    assert not errors and loader.stats.n_requests == 1
    assert all(t.is_alive() for t in loader._threads)
    assert _bytes(cache.slot_views(layer, int(slots[0]))) == _clean(store, ExpertKey(layer, 3))
    loader.close()


def test_demand_waits_for_unneeded_prefetches_still_in_flight(packed_dirs):
    """Wrong forecasts still loading hold slots nobody may evict; a call that needs every
    slot waits for them instead of failing with 'no evictable slot'."""
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layer = store.moe_layers[0]
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=2), reader=reader)
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    cache.prefetch([ExpertKey(layer, e) for e in (20, 21, 22, 23)], round_id=1)
    cache.unprotect(layer)  # the verify pass of this layer begins; the reads are still blocked
    threading.Timer(0.05, reader.gate.set).start()
    t0 = time.perf_counter()
    slots, stats = cache.ensure(layer, np.array([0, 1, 2, 3]))
    assert stats.misses == 4 and time.perf_counter() - t0 < 5
    for e, s in zip(range(4), slots):
        assert _bytes(cache.slot_views(layer, int(s))) == _clean(store, ExpertKey(layer, e))
    cache.unpin(layer, slots)
    loader.close()
