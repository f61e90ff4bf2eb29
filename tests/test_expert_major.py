"""Expert-major prefill (runtime/cache/expert_major.py): bit-identical to stock mlx-lm, each routed
expert read once per call, slots within the budget."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU

from runtime.cache.expert_major import plan_batches, switch_rows
from runtime.checkpoints.tiny import FAMILIES
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, REPRESENTATIVE_FAMILIES, long_tier

BUDGETS = ["100%", "50%", "25%", "min"]
LONG = (PROMPT + " ") * 5  # ~130 tokens: routes to every expert of every layer, far more than 25% of the slots


def _budget(path, budget: str) -> str:
    if budget != "min":
        return budget
    probe = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        return f"{probe.plan.min_bytes}B"
    finally:
        probe.close()


def _prefill_logits(model, ids: list[int], chunk: int) -> list[np.ndarray]:
    """Logits of every prompt position, the prompt fed in chunks of `chunk` tokens into one KV cache."""
    cache = make_prompt_cache(model)
    out = []
    for i in range(0, len(ids), chunk):
        logits = model(mx.array(ids[i : i + chunk])[None], cache=cache)
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
    return out


class _StockLogits(dict):
    """family -> (prompt ids, stock mlx-lm's prefill logits), computed the first time a test asks."""

    def __init__(self, tiny_dirs):
        super().__init__()
        self.tiny_dirs = tiny_dirs

    def __missing__(self, fam):
        model, tok = load(str(self.tiny_dirs[fam]))
        ids = tok.encode(LONG)
        self[fam] = (ids, _prefill_logits(model, ids, 64))
        return self[fam]


@pytest.fixture(scope="module")
def stock_logits(tiny_dirs):
    return _StockLogits(tiny_dirs)  # only the families this run selects pay for their reference


# Representative families by default (plain KV + switch_mlp, hybrid linear-attention state, rotating KV with MXFP4
# experts and biases, shared experts with grouped routing); every family in the long tier (`pytest -m long`).
@pytest.mark.parametrize("family", long_tier(FAMILIES, keep=REPRESENTATIVE_FAMILIES))
def test_prefill_logits_bit_identical_to_stock_and_each_expert_read_once(family, tiny_dirs, stock_logits):
    path = tiny_dirs[family]
    ids, expected = stock_logits[family]
    for budget in BUDGETS:
        om = OffloadedModel.load(path, OffloadConfig(budget=_budget(path, budget)))
        try:
            routed = {}
            om.set_observer(lambda layer, e: routed.setdefault(layer, []).append(np.unique(e)))
            # 64-token chunks: >= 64 (token, expert) pairs, so stock sorts them (the sorted_indices path).
            got = _prefill_logits(om.model, ids, 64)
            usable = min(om.cache.usable_slots(l) for l in om.moe_layers)
            misses = om.counters()["misses"]
        finally:
            om.close()
        for g, e in zip(got, expected):
            assert np.array_equal(g, e), f"{family} at {budget}: logits differ from stock"
        # Every chunk's unique experts exceed the slots below 100%, yet no expert is read twice in a call:
        # the reads are at most the sum over calls of each call's unique experts.
        per_call = sum(len(u) for calls in routed.values() for u in calls)
        assert misses <= per_call, f"{family} at {budget}: {misses} reads for {per_call} routed experts"
        if budget == "100%":
            ever = sum(len(np.unique(np.concatenate(calls))) for calls in routed.values())
            assert misses == ever  # nothing evicted: each expert read once in the whole prefill
        else:
            assert max(len(u) for calls in routed.values() for u in calls) > usable


def test_reads_equal_unique_experts_at_25_percent_where_token_groups_read_more(tiny_dirs):
    """One long call: the old token groups re-read evicted experts; expert-major reads each exactly once."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(LONG)
        routed = {}
        om.set_observer(lambda layer, e: routed.setdefault(layer, np.unique(e)))
        mx.eval(om.model(mx.array(ids)[None], cache=make_prompt_cache(om.model)))
        c = om.counters()
        unique = sum(len(u) for u in routed.values())
        assert c["misses"] == unique
        assert c["bytes_read"] == sum(len(u) * om.store.layout(l).expert_bytes for l, u in routed.items())
        assert unique > 2 * sum(om.plan.slots.values())  # the routed set is far larger than the cache
    finally:
        om.close()


def _random_switch(E=16, D=64, H=32):
    mx.random.seed(3)
    sw = SwitchGLU(D, H, E)
    nn.quantize(sw, group_size=32, bits=4)
    return sw


@pytest.mark.parametrize("n_tokens,k", [(40, 4), (20, 2)])  # 160 pairs (stock sorts), 40 pairs (stock does not)
@pytest.mark.parametrize("batch_cap", [1, 3, 16])
def test_batched_rows_equal_the_stock_switch(n_tokens, k, batch_cap):
    sw = _random_switch()
    rng = np.random.default_rng(n_tokens)
    ids = np.stack([rng.permutation(16)[:k] for _ in range(n_tokens)])[None]
    x = mx.random.normal((1, n_tokens, 64))
    expected = np.array(sw(x, mx.array(ids.astype(np.uint32))))
    flat = ids.reshape(-1, k)
    absent = np.unique(flat)[[0, 2, 5]]
    batches = plan_batches(flat, absent=absent, batch_cap=batch_cap)
    # Resident experts come first; each batch holds whole runs of the stable sort by expert id.
    seen = np.concatenate([b.experts for b in batches])
    assert sorted(seen) == sorted(np.unique(flat))
    has_absent = [i for i, b in enumerate(batches) if np.isin(b.experts, absent).any()]
    has_resident = [i for i, b in enumerate(batches) if not np.isin(b.experts, absent).all()]
    assert max(has_resident) <= min(has_absent)
    assert all(len(b.experts) <= batch_cap for b in batches)
    order = np.argsort(flat.reshape(-1), kind="stable")
    for b in batches:
        assert np.array_equal(b.rows, order[np.isin(flat.reshape(-1)[order], b.experts)])
    xf = x.reshape(-1, 1, 64)
    outs = [switch_rows(sw, xf[mx.array(b.rows // k)], mx.array(flat.reshape(-1)[b.rows].astype(np.uint32)),
                        flat.size >= 64) for b in batches]
    perm = np.concatenate([b.rows for b in batches])
    got = np.empty((flat.size, 64), np.float32)
    got[perm] = np.array(mx.concatenate(outs)[:, 0, :])
    assert np.array_equal(got.reshape(expected.shape), expected)
