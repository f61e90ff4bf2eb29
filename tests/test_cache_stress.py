"""Stress: loader + cache under random demand, prefetch, cancel, unprotect and resize,
with slow, failing and corrupting reads on several I/O threads.

What must hold after every call and at the end: every slot a call is served holds the
bytes of the expert it claims (CRC of the slot == the store's CRC of that record); a
failed load leaves that expert without a valid slot and nothing of the call pinned;
no I/O thread dies; the two maps of the slot table stay inverse; nothing stays
loading or pinned once everything is released.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest

from runtime.cache.expert_cache import ExpertCache
from runtime.cache.slot_table import FREE, LOADING, VALID
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig, StoreError
from storage.faults import FaultyReader
from storage.reader import RangeReader

ROUNDS = 300
SLOTS = 10
TOP_K = 3


def _slot_crc(cache, layer, slot) -> int:
    crc = 0
    for v in cache.slot_views(layer, slot):
        crc = zlib.crc32(v, crc)
    return crc


def _check_table(cache) -> None:
    with cache._lock:  # I/O threads commit and abort under it: unlocked, a check could see half an abort
        _check_table_locked(cache)


def _check_table_locked(cache) -> None:
    for layer, ls in cache.table.layers.items():
        occupied = np.flatnonzero(ls.slot_to_expert >= 0)
        assert (ls.expert_to_slot[ls.slot_to_expert[occupied]] == occupied).all(), f"layer {layer}: maps not inverse"
        assert ((ls.expert_to_slot >= 0).sum()) == len(occupied)
        assert (ls.state[ls.slot_to_expert < 0] == FREE).all()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_random_demand_prefetch_cancel_resize(packed_dirs, seed):
    rng = np.random.default_rng(seed)
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layers = store.moe_layers
    n_experts = store.layout(layers[0]).n_experts
    # Slow reads make prefetches overlap demand; rare EIO, short reads and flips exercise the
    # retries, and the occasional double fault makes a load fail for good.
    faults = (f"slow:ms=1,p=0.3,seed={seed};eio:p=0.05,seed={seed + 1};short:p=0.03,seed={seed + 2};"
              f"flip:p=0.03,seed={seed + 3}")
    reader = FaultyReader(RangeReader(), faults, store)
    loader = AsyncLoader(store, LoaderConfig(threads=4, verify_checksums=True, max_retries=4, retry_backoff_ms=0.05),
                         reader=reader)
    cache = ExpertCache({l: store.layout(l) for l in layers}, {l: SLOTS for l in layers}, loader, min_usable=TOP_K)
    thread_errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: thread_errors.append(a.exc_value)

    # The governor's side: resize requests from another thread, all through the run.
    stop = threading.Event()

    def governor():
        r = np.random.default_rng(seed + 100)
        while not stop.wait(0.002):
            cache.request_usable_slots(int(r.integers(TOP_K, SLOTS + 1)))

    gov = threading.Thread(target=governor)
    gov.start()
    held: dict[int, np.ndarray] = {}  # slots a "pending graph" of each layer still reads
    served = failed = 0
    try:
        for round_id in range(1, ROUNDS + 1):
            if rng.random() < 0.7:  # drafting: forecast some experts of a few layers
                keys = [ExpertKey(int(l), int(e)) for l in rng.choice(layers, 2, replace=False)
                        for e in rng.choice(n_experts, int(rng.integers(1, 6)), replace=False)]
                cache.prefetch(keys, round_id, max_bytes=None if rng.random() < 0.5 else int(rng.integers(1, 8)) * 10**4)
                if rng.random() < 0.3:
                    loader.cancel_stale(round_id + 1)  # drop what is still queued (reads are slow)
            for layer in layers:  # verify: each layer once, as CachedSwitchGLU calls it
                if layer in held:
                    cache.unpin(layer, held.pop(layer))
                cache.unprotect(layer)
                capacity = cache.usable_slots(layer)
                experts = np.sort(rng.choice(n_experts, int(rng.integers(1, capacity + 1)), replace=False))
                try:
                    slots, _ = cache.ensure(layer, experts)
                except StoreError as e:
                    failed += 1
                    assert "of layer" in str(e) and "offset" in str(e)
                    ls = cache.table.layers[layer]
                    for x in experts:
                        s = ls.expert_to_slot[x]
                        assert s < 0 or ls.state[s] != VALID or _slot_crc(cache, layer, s) == store.checksum(ExpertKey(layer, int(x)))
                    continue
                ls = cache.table.layers[layer]
                for x, s in zip(experts, slots):
                    assert ls.slot_to_expert[s] == x and ls.state[s] == VALID and ls.pins[s] > 0
                    assert _slot_crc(cache, layer, int(s)) == store.checksum(ExpertKey(layer, int(x))), \
                        f"slot {s} of layer {layer} does not hold expert {x}"
                served += len(experts)
                held[layer] = slots
            if rng.random() < 0.5:
                loader.cancel_stale(round_id + 1)  # the rewind: drop this round's queued prefetches
            cache.unprotect()
            _check_table(cache)
    finally:
        stop.set()
        gov.join()
        for layer, slots in held.items():
            cache.unpin(layer, slots)
        cache.unprotect()
        loader.drain()
        threading.excepthook = old_hook
    cache.set_usable_slots(TOP_K)
    _check_table(cache)
    for layer, ls in cache.table.layers.items():
        assert (ls.pins == 0).all() and not (ls.state == LOADING).any()
        assert not (ls.state[TOP_K:] == VALID).any()
        for s in np.flatnonzero(ls.state == VALID):
            assert _slot_crc(cache, layer, int(s)) == store.checksum(ExpertKey(layer, int(ls.slot_to_expert[s])))
    assert not thread_errors, thread_errors
    assert all(t.is_alive() for t in loader._threads)
    # (How many prefetches got cancelled or promoted depends on thread timing: not asserted.)
    assert served > ROUNDS and loader.stats.n_retries > 0 and cache.resize_stats.n_shrinks > 0
    assert set(reader.counts) == {"slow", "eio", "short", "flip"}
    loader.close()
