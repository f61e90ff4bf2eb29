"""Cache replay: known hit counts, Belady's MIN, and equality with the live cache."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.cache import allocate_slots, belady, miss_curve, replay


def _seq(*rows):
    return [np.array([[r] if np.isscalar(r) else r for r in rows])]


def test_lru_and_belady_on_a_textbook_sequence():
    # Requests 1 2 3 1 4 1 2 with 3 slots.
    s = _seq(1, 2, 3, 1, 4, 1, 2)
    lru = replay(s, 8, 3, "lru")
    assert (lru.hits, lru.misses) == (2, 5)  # hits: 1, 1 ; 4 evicts 2, then 2 misses
    opt = belady(s, 3)
    assert (opt.hits, opt.misses) == (3, 4)  # 4 evicts 3 (never used again): 1, 1, 2 hit
    lfu = replay(s, 8, 3, "lfu")
    assert lfu.misses >= opt.misses


def test_belady_is_a_lower_bound_for_every_policy():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32, (300, 4))]
    seqs = [np.stack([rng.choice(32, 4, replace=False) for _ in range(300)])]
    for slots in (4, 8, 16, 24):
        best = belady(seqs, slots).misses
        for policy in ("lru", "lfu"):
            assert replay(seqs, 32, slots, policy).misses >= best
        assert replay(seqs, 32, slots, "lru", forecast_recall=0.9).misses >= best


def test_windows_count_unique_experts_once():
    s = _seq([1, 2], [1, 2], [3, 4], [3, 4])
    assert replay(s, 8, 4, window=2).misses == 4 and replay(s, 8, 4, window=2).windows == 2
    assert replay(s, 8, 4, window=1).hits == 4  # the repeated token hits both experts
    with pytest.raises(ValueError, match="needs 4 experts"):
        belady(s, 3, window=4)


def test_forecasts_help_lru_when_they_are_right():
    rng = np.random.default_rng(1)
    base = [rng.choice(16, 2, replace=False) for _ in range(4)]
    seqs = [np.stack([base[(i // 3) % 4] if i % 2 else rng.choice(16, 2, replace=False) for i in range(600)])]
    plain = replay(seqs, 16, 6, "lru").misses
    assert replay(seqs, 16, 6, "lru", forecast_recall=1.0).misses <= plain


def test_slot_allocation_follows_miss_curves():
    curves = {0: {2: 100, 3: 90, 4: 85, 5: 84}, 1: {2: 100, 3: 50, 4: 20, 5: 0}}
    assert allocate_slots(curves, 7, 2) == {0: 2, 1: 5}
    assert allocate_slots(curves, 4, 2) == {0: 2, 1: 2}
    with pytest.raises(ValueError):
        allocate_slots(curves, 3, 2)


def test_replay_equals_the_live_cache(tiny_dirs):
    """One implementation: the live cache's counts on a decode run equal the replay of its trace."""
    from mlx_lm.generate import generate_step
    import mlx.core as mx

    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel

    for policy in ("lru", "lfu", "dlfu"):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%", policy=policy, trace=True))
        try:
            om.telemetry.new_sequence()
            gen = generate_step(mx.array([om.tokenizer.encode("The")[0]]), om.model, max_tokens=40)
            for _ in zip(range(40), gen):
                pass
            om.end_round()
            seqs = om.telemetry.trace_sequences()
            for i, layer in enumerate(om.moe_layers):
                live = om.cache.stats()[layer]
                r = replay([seqs[0][:, i]], 32, om.cache.n_slots(layer), policy)
                assert (r.hits, r.misses) == (live.hits, live.misses), (policy, layer)
                assert miss_curve([seqs[0][:, i]], 32, [om.cache.n_slots(layer)], policy)[om.cache.n_slots(layer)] == live.misses
        finally:
            om.close()
