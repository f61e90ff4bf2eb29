"""Memory governor: shrinks the cache under a (fake) low-memory reading, grows it back,
returns slab pages to the OS, and never changes a token."""

from __future__ import annotations

import sys
import time
import zlib

import numpy as np
import psutil
import pytest

from runtime.cache.expert_cache import ExpertCache
from runtime.cache.governor import GovernorConfig, MemoryGovernor, MemoryReading, decide, read_memory
from runtime.cache.slot_table import FREE, LOADING
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig
from storage.layout import ExpertTensor, LayerLayout
from tests.conftest import PROMPT, greedy_ids

GiB = 1 << 30
CFG = GovernorConfig(low_bytes=2 * GiB, high_bytes=4 * GiB, step=0.25)


def reading(avail_gib: float, pressure=None) -> MemoryReading:
    return MemoryReading(int(avail_gib * GiB), 16 * GiB, pressure)


class FakeMemory:
    """Readings from a script; repeats the last one."""

    def __init__(self, script):
        self.script, self.i = list(script), 0

    def __call__(self) -> MemoryReading:
        r = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        return r


@pytest.mark.parametrize("avail,pressure,level,expected", [
    (1.0, None, 1.0, 0.75),  # below low: step down
    (1.0, None, 0.0, 0.0),  # never below 0
    (3.0, None, 0.5, 0.5),  # between low and high: hold (hysteresis)
    (5.0, None, 0.5, 0.75),  # above high: step up
    (5.0, None, 1.0, 1.0),  # never above 1
    (5.0, "warn", 1.0, 0.75),  # macOS warn: step down even with RAM free
    (5.0, "critical", 1.0, 0.0),  # macOS critical: straight to the floor
])
def test_decide(avail, pressure, level, expected):
    assert decide(reading(avail, pressure), level, CFG) == expected


def test_config_defaults_and_validation():
    low, high = GovernorConfig().thresholds(16 * GiB)
    assert low == 16 * GiB // 10
    assert high > low
    assert GovernorConfig().thresholds(4 * GiB)[0] == GiB  # at least 1 GiB
    for bad in (dict(step=0), dict(step=1.5), dict(interval_s=0), dict(low_bytes=5, high_bytes=4)):
        with pytest.raises(ValueError, match="GovernorConfig"):
            GovernorConfig(**bad)
    r = read_memory()
    assert 0 < r.available_bytes <= r.total_bytes
    assert r.pressure is None or sys.platform == "darwin"


@pytest.fixture()
def cache_setup(packed_dirs):
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    loader = AsyncLoader(store, LoaderConfig(threads=2))
    layers = store.moe_layers[:2]
    cache = ExpertCache({l: store.layout(l) for l in layers}, {l: 16 for l in layers}, loader, min_usable=4)
    yield store, loader, cache, layers
    loader.close()
    store.close()


def _crc_ok(store, cache, layer, slot) -> bool:
    e = int(cache.table.layers[layer].slot_to_expert[slot])
    crc = 0
    for v in cache.slot_views(layer, slot):
        crc = zlib.crc32(v, crc)
    return crc == store.checksum(ExpertKey(layer, e))


def test_governor_shrinks_holds_and_grows_back(cache_setup):
    store, loader, cache, layers = cache_setup
    for l in layers:
        slots, _ = cache.ensure(l, np.arange(16))
        cache.unpin(l, slots)
    script = [reading(a) for a in (1, 1, 1, 1, 1, 3, 3, 5, 5, 5, 5)]
    gov = MemoryGovernor(cache, CFG, read=FakeMemory(script))
    seen = []
    for _ in script:
        gov.tick()
        seen.append([cache.usable_slots(l) for l in layers][0])  # a call of each layer applies the resize
        for l in layers[1:]:
            cache.usable_slots(l)
    # floor = top-k (4): 16 -> 13 -> 10 -> 7 -> 4 -> 4, hold, hold, then back up to 16.
    assert seen == [13, 10, 7, 4, 4, 4, 4, 7, 10, 13, 16]
    assert (gov.stats.n_shrinks, gov.stats.n_grows, gov.stats.level) == (4, 4, 1.0)
    c = gov.counters()
    assert c["governor_shrinks"] == 4 and c["usable_slots"] == 32
    assert c["resize_evicted"] == 2 * 12  # every valid expert beyond slot 4 went, in both layers
    for l in layers:
        assert cache.table.valid_count(l) == 4 and cache.table.layers[l].stats.shrink_evictions == 12
    # Growing back: the freed slots fill again with the right bytes.
    for l in layers:
        slots, _ = cache.ensure(l, np.arange(16, 32))
        assert all(_crc_ok(store, cache, l, int(s)) for s in slots)
        cache.unpin(l, slots)


def test_pinned_and_loading_experts_beyond_usable_go_when_released(cache_setup, monkeypatch):
    store, loader, cache, layers = cache_setup
    l = layers[0]
    slots, _ = cache.ensure(l, np.arange(12))  # pinned, as if a graph were still reading them
    assert cache.set_usable_slots(6) == 0  # nothing evictable yet
    ls = cache.table.layers[l]
    assert cache.usable_slots(l) == 6 and ls.usable == 6 and cache.table.valid_count(l) == 12
    cache.unpin(l, slots)
    assert cache.table.valid_count(l) == 6 and (ls.state[6:] == FREE).all()
    # A new expert never lands beyond usable, even when slots there are free.
    new, _ = cache.ensure(l, np.array([20, 21]))
    assert (new < 6).all()
    cache.unpin(l, new)
    assert cache.set_usable_slots(1) == 6 - 4  # clamped to top-k = 4: the two LRU experts go
    assert ls.usable == 4


def test_a_prefetch_in_flight_beyond_usable_is_dropped_after_it_lands(packed_dirs):
    from tests.conftest import GatedReader

    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    l = store.moe_layers[0]
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    cache = ExpertCache({l: store.layout(l)}, {l: 8}, loader, min_usable=2)
    cache.prefetch([ExpertKey(l, e) for e in range(8)], round_id=1)
    cache.unprotect()
    cache.set_usable_slots(2)
    ls = cache.table.layers[l]
    assert (ls.state[2:] == LOADING).all()  # in flight: left alone
    reader.gate.set()
    loader.drain()
    assert cache.table.valid_count(l) == 2 and (ls.state[2:] == FREE).all()
    loader.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release uses madvise(MADV_DONTNEED) on Linux only")
def test_shrinking_returns_slab_pages_to_the_os():
    mib = 1 << 20
    lay = LayerLayout(0, "model.layers.0.mlp.switch_mlp", 64, (ExpertTensor("gate_proj.weight", "U8", (mib,), mib),),
                      {"gate_proj": None})
    cache = ExpertCache({0: lay}, {0: 32}, loader=None, min_usable=4)
    for s in range(32):
        cache.slot_views(0, s)[0][:] = 7  # touch every page
    rss = psutil.Process().memory_info().rss
    cache.set_usable_slots(4)
    released = cache.resize_stats.bytes_released
    assert released >= 27 * mib  # 28 slots' pages, less the partial pages at the edges
    assert rss - psutil.Process().memory_info().rss > 20 * mib
    assert not cache.slot_views(0, 10)[0].any()  # the pages are gone: they read back as zeros
    assert (cache.slot_views(0, 3)[0] == 7).all()  # usable slots are untouched
    cache.set_usable_slots(32)
    cache.slot_views(0, 10)[0][:] = 9  # grown back: the slot is writable memory again
    assert (cache.slot_views(0, 10)[0] == 9).all()


def test_governor_thread_starts_and_stops(cache_setup):
    _, _, cache, layers = cache_setup
    gov = MemoryGovernor(cache, GovernorConfig(low_bytes=2 * GiB, high_bytes=4 * GiB, interval_s=0.01),
                         read=FakeMemory([reading(1)])).start()
    deadline = time.monotonic() + 10
    while gov.stats.level > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    gov.stop()
    assert gov.stats.n_readings >= 4 and gov._thread is None
    assert cache.usable_slots(layers[0]) == 4


def test_a_failing_reading_is_skipped():
    def broken():
        raise OSError("no /proc")

    class _Cache:
        table = type("T", (), {"layers": {}})()

    gov = MemoryGovernor(_Cache(), CFG, read=broken)
    assert gov.tick() == 1.0 and gov.stats.n_errors == 1


@pytest.mark.parametrize("speculative", [False, True])
def test_tokens_unchanged_while_the_governor_resizes(tiny_dirs, packed_dirs, speculative):
    from mlx_lm import load

    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
    from runtime.decode.speculative_run import run_speculative

    path = packed_dirs["qwen3_moe"]
    stock, tok = load(str(tiny_dirs["qwen3_moe"]))
    ids = tok.encode(PROMPT)
    expected = greedy_ids(stock, ids, 16)
    om = OffloadedModel.load(path, OffloadConfig(budget="100%", threads=2))
    try:
        # Memory alternates: scarce for 6 readings, plentiful for 6, ...; one reading per MoE call.
        script = ([reading(1)] * 6 + [reading(5)] * 6) * 200
        om.governor = MemoryGovernor(om.cache, GovernorConfig(low_bytes=2 * GiB, high_bytes=4 * GiB, step=0.5),
                                     read=FakeMemory(script))
        usable_seen = set()

        def tick(layer, ids_):
            om.governor.tick()
            usable_seen.add(om.cache.table.layers[layer].usable)

        if speculative:
            # The target's own weights as drafter: drafts are accepted, so prefetch is exercised.
            drafter = stock
            tokens, _, _ = _spec_with_ticks(om, ids, drafter, tick, run_speculative)
        else:
            om.set_observer(tick)
            tokens = greedy_ids(om.model, ids, 16)
        c = om.counters()
    finally:
        om.close()
    assert tokens == expected
    assert c["governor_shrinks"] > 0 and c["governor_grows"] > 0 and c["resize_evicted"] > 0
    assert min(usable_seen) == 4 and max(usable_seen) == 32  # top-k .. the full budget
    if speculative:
        assert c["prefetch_loaded"] > 0  # prefetches landed while slots came and went


def _spec_with_ticks(om, ids, drafter, tick, run_speculative):
    """Run speculative decoding with `tick` called on every MoE call of the target."""
    real_set_observer = om.set_observer

    def chained(observer):
        if observer is None:
            real_set_observer(tick)
        else:
            real_set_observer(lambda layer, x: (tick(layer, x), observer(layer, x)))

    om.set_observer = chained
    om.set_observer(None)
    try:
        return run_speculative(om, None, ids, max_tokens=16, num_draft=3, predictor="previous", cutoff=None,
                               draft_model=drafter, draft_config=om.config)
    finally:
        om.set_observer = real_set_observer
        real_set_observer(None)


def test_offload_config_governor_runs_a_thread_until_close(packed_dirs):
    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel

    om = OffloadedModel.load(packed_dirs["qwen3_moe"], OffloadConfig(budget="50%", governor=GovernorConfig(interval_s=0.05)))
    thread = om.governor._thread
    assert thread is not None and thread.is_alive()
    assert {"governor_shrinks", "usable_slots", "bytes_released"} <= set(om.counters())
    om.close()
    assert not thread.is_alive()


def test_on_macos_a_shrink_evicts_but_returns_no_memory(monkeypatch):
    """What the governor does where release_pages cannot return memory (macOS, simulated by the
    platform name): experts beyond the usable slots are evicted and never refilled, the slab keeps
    its size and bytes, 0 bytes are reported released, and returns_memory says so."""
    import runtime.cache.slab as slab

    monkeypatch.setattr(slab.sys, "platform", "darwin")
    kib = 1 << 10
    lay = LayerLayout(0, "model.layers.0.mlp.switch_mlp", 64, (ExpertTensor("gate_proj.weight", "U8", (64 * kib,), 64 * kib),),
                      {"gate_proj": None})
    cache = ExpertCache({0: lay}, {0: 8}, loader=None, min_usable=2)
    for s in range(8):
        cache.slot_views(0, s)[0][:] = 7
        key = ExpertKey(0, s)
        cache.table.reserve(key)
        cache.table.commit(key)
    assert cache.set_usable_slots(2) == 6  # evicted
    assert cache.resize_stats.bytes_released == 0 and not slab.pages_returnable()
    assert cache.nbytes == 8 * 64 * kib and (cache.slot_views(0, 7)[0] == 7).all()  # the memory is still there
    assert cache.table.valid_count(0) == 2
    gov = MemoryGovernor(cache, GovernorConfig())
    assert gov.counters()["returns_memory"] == 0 and gov.counters()["bytes_released"] == 0
    monkeypatch.setattr(slab.sys, "platform", "linux")
    assert gov.counters()["returns_memory"] == 1  # Linux: madvise returns the pages
