"""Slots per layer from miss curves: same total, more slots where they save reads, used live."""

from __future__ import annotations

import numpy as np

from runtime.decode import generate_tokens
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.observe import RoutingTrace
from runtime.cache import replay, split_by_miss_curves
from tests.conftest import PROMPT, greedy_ids


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


def test_a_split_cache_is_lossless_and_keeps_the_total(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%", trace=True))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, 12)
        om.telemetry.new_sequence()
        generate_tokens(om.model, ids, max_tokens=24, om=om, one_sync="off")
        om.end_round()
        RoutingTrace(om.model_id(), om.telemetry.trace_sequences()).save(tmp_path / "t.smtrace")
        equal = dict(om.plan.slots)
    finally:
        om.close()
    om = OffloadedModel.load(path, OffloadConfig(budget="50%", slot_trace=tmp_path / "t.smtrace"))
    try:
        assert sum(om.plan.slots.values()) == sum(equal.values()) and min(om.plan.slots.values()) >= om.top_k
        assert {l: om.cache.n_slots(l) for l in om.moe_layers} == om.plan.slots
        assert greedy_ids(om.model, ids, 12) == expected
    finally:
        om.close()
