"""Slots per layer from miss curves (the cache sweep's analysis): same total, more slots where they save reads."""

from __future__ import annotations

import numpy as np

from runtime.observe import RoutingTrace
from runtime.cache import replay, split_by_miss_curves


def _trace(rng, n_tokens=600):
    """Layer 0 routes among 5 experts only; layer 1 spreads over all 32."""
    narrow = np.stack([rng.choice(5, 2, replace=False) for _ in range(n_tokens)])
    wide = np.stack([rng.choice(32, 2, replace=False) for _ in range(n_tokens)])
    model = {"name": "t", "model_type": "qwen3_moe", "digest": "x", "n_experts": 32, "top_k": 2, "moe_layers": [0, 1]}
    return RoutingTrace(model, [np.stack([narrow, wide], axis=1)])


def test_the_layer_that_gains_gets_the_slots():
    tr = _trace(np.random.default_rng(0))
    split = split_by_miss_curves(tr, {0: 10, 1: 10}, minimum=2)
    assert sum(split.values()) == 20 and split[0] < 10 < split[1] and split[0] >= 5  # 5 cover layer 0 entirely
    misses = lambda s: sum(replay([tr.layer(i)[0]], 32, s[l], "dlfu").misses for i, l in enumerate((0, 1)))  # noqa: E731
    assert misses(split) < misses({0: 10, 1: 10})
    assert split_by_miss_curves(tr, {0: 10, 1: 10, 7: 4}, minimum=2)[7] == 4  # a layer the trace lacks keeps its slots
