"""Read less: prefetch admission in the forecast replay, the frequency oracles beside
Belady's MIN, and the lookahead's default confidence threshold on replayed forecasts."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.tune import belady, future_frequency_misses, replay, replay_prefetch


def _hot_and_cold(seed: int = 0, tokens: int = 400, n: int = 32) -> list[np.ndarray]:
    """Each token: 3 experts of a hot set of 6, 1 of the 26 cold ones."""
    rng = np.random.default_rng(seed)
    rows = [np.concatenate([rng.choice(6, 3, replace=False), rng.choice(np.arange(6, n), 1)]) for _ in range(tokens)]
    return [np.stack(rows)]


def test_free_only_admission_never_evicts_for_a_forecast():
    seqs = _hot_and_cold()
    rng = np.random.default_rng(1)
    noise = [rng.choice(32, (len(seqs[0]), 4)) for _ in seqs]  # a forecast that knows nothing
    anyslot = replay_prefetch(seqs, noise, 32, 8, "dlfu")
    free = replay_prefetch(seqs, noise, 32, 8, "dlfu", admit="free")
    # Once the cache is full no slot is ever free again: at most `slots` speculative reads, none evicting.
    assert 0 < free.prefetch_reads <= 8
    assert anyslot.prefetch_reads > 10 * free.prefetch_reads and anyslot.prefetch_wasted > 0
    assert free.reads < anyslot.reads
    with pytest.raises(ValueError, match="admit"):
        replay_prefetch(seqs, noise, 32, 8, "dlfu", admit="cheap")


def test_frequency_oracles_sit_between_belady_and_lru_on_a_hot_set():
    seqs = _hot_and_cold()
    opt = belady(seqs, 8).misses
    lru = replay(seqs, 32, 8, "lru").misses
    whole = future_frequency_misses(seqs, 8)
    near = future_frequency_misses(seqs, 8, horizon=1)
    far = future_frequency_misses(seqs, 8, horizon=64)
    assert opt <= min(whole, near, far)  # Belady's MIN is optimal
    assert whole < lru  # knowing which experts are hot keeps them; LRU lets cold ones push them out
    assert far < lru
    with pytest.raises(ValueError, match="horizon"):
        future_frequency_misses(seqs, 8, horizon=0)
    with pytest.raises(ValueError, match="slots"):
        future_frequency_misses(seqs, 2)


def test_future_frequency_with_the_whole_passage_keeps_the_hot_set():
    """Hot experts are never evicted by the passage-frequency oracle with room for them plus the token's
    cold one: misses are the 6 hot experts' first reads plus one per cold use."""
    seqs = _hot_and_cold()
    cold_uses = sum(len(np.unique(s[t][3:])) for s in seqs for t in range(len(s)))
    cold_first_repeats = 0  # a cold expert used on two consecutive tokens is still resident
    for s in seqs:
        for t in range(1, len(s)):
            cold_first_repeats += int(s[t][3] == s[t - 1][3])
    assert future_frequency_misses(seqs, 8) <= 6 + cold_uses - cold_first_repeats
