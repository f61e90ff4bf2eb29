"""The hit path's bookkeeping shortcuts book exactly what the general path books: a policy's batch
on_access_many equals on_access one by one, and a hit forward booked from its lookup codes
(ResidentTables.record_hit_forward) leaves the same stats and eviction ranking as record_forward() with
its expert ids -- or refuses once an expert lost its slot since the mark."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.cache import SlotTable
from runtime.cache.decayed_lfu import DecayedLFUPolicy
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from storage import ExpertKey


def test_dlfu_batch_access_equals_one_by_one():
    rng = np.random.default_rng(0)
    a, b = DecayedLFUPolicy(8, half_life=16), DecayedLFUPolicy(8, half_life=16)
    for p in (a, b):
        for slot in range(8):
            p.on_insert(slot, expert=slot + 10)
    for _ in range(50):
        slots = rng.integers(0, 8, size=4).tolist()
        for s in slots:
            a.on_access(s)
        b.on_access_many(slots)
    assert (a._tick, a._count, a._stamp, a._last) == (b._tick, b._count, b._stamp, b._last)
    assert a.victim(list(range(8))) == b.victim(list(range(8)))


@pytest.mark.parametrize("policy", ["dlfu", "lru"])
def test_slot_table_books_the_same_with_or_without_a_batch_policy(policy):
    t1, t2 = SlotTable({0: 16}, {0: 8}, policy), SlotTable({0: 16}, {0: 8}, policy)
    for t in (t1, t2):
        for e in range(8):
            t.reserve(ExpertKey(0, e))
            t.commit(ExpertKey(0, e))
    t2.layers[0].policy.on_access_many = None if policy == "lru" else t2.layers[0].policy.on_access_many
    for ids in ([1, 2, 3, 4], [4, 5, 6, 7], [1, 3, 5, 7]):
        t1.record_use(0, np.array(ids), 0)
        slots = t2.layers[0].expert_to_slot[np.array(ids)].tolist()
        t2.record_slots(0, slots, None, len(ids), 0)
    assert t1.layers[0].stats == t2.layers[0].stats
    assert t1.layers[0].policy.victim(list(range(8))) == t2.layers[0].policy.victim(list(range(8)))


def test_hit_forward_from_codes_books_what_record_forward_books(tiny_dirs):
    oms = [OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%")) for _ in range(2)]
    try:
        layers = oms[0].moe_layers
        for om in oms:  # the same experts read into the same slots of both caches
            om.cache.load_absent({l: np.arange(min(8, om.cache.usable_slots(l))) for l in layers})
        rng = np.random.default_rng(1)
        for _ in range(5):
            rows = []
            for layer in layers:  # experts resident in both caches (same warm start, same table)
                valid = np.flatnonzero(oms[0].cache.table.layers[layer].expert_to_slot >= 0)
                rows.append(rng.choice(valid, size=oms[0].top_k, replace=False).astype(np.int64))
            oms[0].cache.record_forward([(l, r, 0, 0, 0, 0.0) for l, r in zip(layers, rows)])
            slots = [oms[1].cache.table.layers[l].expert_to_slot[r].tolist() for l, r in zip(layers, rows)]
            used = oms[1].cache.record_hit_forward(layers, slots, oms[1].cache.eviction_mark())
            assert used == [0] * len(layers)
        for l in layers:
            a, b = oms[0].cache.table.layers[l], oms[1].cache.table.layers[l]
            assert a.stats == b.stats
            candidates = np.flatnonzero(a.expert_to_slot >= 0)
            assert a.policy.victim(a.expert_to_slot[candidates].tolist()) == \
                b.policy.victim(b.expert_to_slot[candidates].tolist())
        # An eviction since the mark: the codes may name other experts now; the shortcut refuses.
        cache = oms[1].cache
        mark = cache.eviction_mark()
        layer = layers[0]
        absent = np.flatnonzero(cache.table.layers[layer].expert_to_slot < 0)[: 1]
        cache.load_absent({layer: absent})
        if cache.eviction_mark() != mark:
            assert cache.record_hit_forward(layers, slots, mark) is None
        else:  # a free slot took it: no expert moved
            assert cache.record_hit_forward(layers, slots, mark) is not None
    finally:
        for om in oms:
            om.close()


@pytest.mark.parametrize("budget", ["100%", "50%"])
def test_deferred_bookkeeping_books_what_booking_each_forward_books(budget, tiny_dirs, monkeypatch):
    """The decode loop books hit forwards DEFER_FORWARDS at a time; every stat, the telemetry and the
    eviction choices (hence misses) come out as when each forward is booked right away."""
    import mlx.core as mx

    import runtime.decode.bookkeeping as bookkeeping
    from runtime.decode import DevicePass, offloaded_generate_step
    from runtime.decode.warm import warm_start
    from tests.conftest import PROMPT

    def run(defer_forwards):
        monkeypatch.setattr(bookkeeping, "DEFER_FORWARDS", defer_forwards)
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            warm_start(om)
            dp = DevicePass(om)
            gen = offloaded_generate_step(om, mx.array(om.tokenizer.encode(PROMPT)), max_tokens=40,
                                          sampler=lambda x: mx.argmax(x, axis=-1), device_pass=dp,
                                          after_prefill=om.cache.settle_inflight)
            tokens = [t for t, _ in gen]
            stats = {l: ls.stats for l, ls in om.cache.table.layers.items()}
            summary = {k: v for k, v in om.telemetry.summary().items() if k != "stall_ms"}  # a time: differs
            return tokens, stats, summary, om.telemetry.n_rounds, dp.stats.repairs
        finally:
            om.close()

    assert run(bookkeeping.DEFER_FORWARDS) == run(1)
