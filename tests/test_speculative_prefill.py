"""Speculative decoding's prefill runs expert-major: the prompt goes to the target in one chunk (unless a
memory limit needs smaller ones), each routed expert is read once, and the output stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load

from runtime.cache import ContextGovernor, MemoryLimit, activation_bytes
from runtime.checkpoints.tiny import make_tiny
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import run_speculative
from tests.conftest import PROMPT, TINY, greedy_ids

N = 8
LONG = (PROMPT + " ") * 24  # ~600 tokens: more than the old 512-token chunks


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


def _run(path, budget: str, drafter):
    om = OffloadedModel.load(path, OffloadConfig(budget=budget))
    try:
        ids = om.tokenizer.encode(LONG)
        routed: dict[int, set] = {}

        def observe(layer, e):
            if e.shape[0] >= 64:  # prefill calls (verify windows are K + 1 tokens)
                routed.setdefault(layer, set()).update(np.unique(e).tolist())

        om.set_observer(observe)
        tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                                           draft_model=drafter[0], draft_config=drafter[1])
        return ids, tokens, stats, sum(len(s) for s in routed.values())
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_speculative_prefill_reads_each_routed_expert_once_and_stays_lossless(family, tiny_dirs, drafter):
    path = tiny_dirs[family]
    stock, _ = load(str(path))
    ids, tokens, stats, distinct = _run(path, "25%", drafter)
    assert len(ids) > 512
    assert tokens == greedy_ids(stock, ids, N)
    assert stats.prefill.chunk_tokens >= len(ids) - 1  # one chunk: the old 512-token chunks read experts twice
    # Every expert the prompt routes in any layer read exactly once over the whole prefill (25%: the cache holds
    # a quarter of them, so a second chunk would read evicted ones again).
    assert stats.prefill.reads == distinct


def test_speculative_under_a_memory_limit_gives_slots_back_and_stays_lossless(tiny_dirs, drafter):
    """A cap that holds every slot at a short context but not at the long prompt's: the target's slots shrink
    during the speculative prefill (and its chunk may), the output is stock's."""
    path = tiny_dirs["qwen3_moe"]
    stock, _ = load(str(path))
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        ids = om.tokenizer.encode(LONG)
        cache, cfg = om.cache, om.config
        row = sum(cache.layouts[l].expert_bytes for l in cache.layers())
        kv_per_token = 2 * 3 * 2 * 16 * 4  # 3 attention layers x K,V x 2 KV heads x head_dim 16 x float32
        early = activation_bytes(cfg, 16, 16) + (16 + 256) * kv_per_token + 32 * row
        gov = ContextGovernor(cache, MemoryLimit(int(early / 0.95) + row, 0, 0), cfg, 2048, kv_per_token=kv_per_token)
        assert gov.slots_for((len(ids) + 256) * kv_per_token, len(ids)) < 32
        om.context_governor = gov
        tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                                           draft_model=drafter[0], draft_config=drafter[1])
        assert tokens == greedy_ids(stock, ids, N)
        assert gov.stats.n_shrinks >= 1 and max(cache.usable_slots(l) for l in cache.layers()) == gov.stats.usable < 32
        assert stats.prefill.chunk_tokens == gov.chunk_for(len(ids) - 1, len(ids) + 4)
    finally:
        om.close()
