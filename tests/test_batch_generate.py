"""Batched decoding over the paged model (runtime/decode/batch.py, runtime/batch_api.py).

Lossless, defined as mlx-lm defines batching: the tokens equal those of mlx-lm's BatchGenerator on the
resident model given the same prompts and the same schedule of inserts, removals and steps. Checked for
every family of the tiny fixtures at budgets 100%, 50% and 25%, with sequences of different prompt and
output lengths that join between steps and one that is removed (a cancelled request) mid-stream; also
when the cache shrinks to its minimum mid-batch (memory pressure: the union then exceeds a layer's slots
and runs expert-major); and for random schedules of joins, leaves and steps at 25% (hypothesis). The long
tier adds every family at the minimum budget (top-k slots per layer). A planted
wrong slot (every sequence of a batched call given the first sequence's slots) is caught. The counters are
checked against a case whose answer is known: identical prompts route identically, so a
step's union is one sequence's experts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import batch_generate as stock_batch_generate
from mlx_lm import load as stock_load
from mlx_lm.generate import BatchGenerator

from runtime import batch_generate, load
from runtime.checkpoints.tiny import FAMILIES
from runtime.decode.batch import BatchDecoder
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel

BUDGETS = ["100%", "50%", "25%"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Experts", "Experts live on disk and the loader fetches them",
         "a b c", "Once upon a time"]
MAX_TOKENS = [10, 6, 12, 8, 9]


def run_schedule(gen, insert, remove, prompts: list[list[int]], before_step=None) -> dict[int, list[int]]:
    """Two sequences start, two join after 2 steps, one joins after 4, the third is removed after 5; then to
    the end; before_step(step) is called before each step. Returns {prompt index: tokens} (the removed one: what
    it had)."""
    uid_of = {}
    out: dict[int, list[int]] = {}
    plan = {0: [0, 1], 2: [2, 3], 4: [4]}
    step = 0
    while True:
        if step in plan:
            for i, uid in zip(plan[step], insert([prompts[i] for i in plan[step]], [MAX_TOKENS[i] for i in plan[step]])):
                uid_of[uid] = i
                out[i] = []
        if before_step is not None:
            before_step(step)
        if step == 5:
            remove([next(u for u, i in uid_of.items() if i == 2)])
        responses = gen()
        if not responses and step > max(plan):
            return out
        for r in responses:
            out[uid_of[r.uid]].append(r.token)
        step += 1


def stock_tokens(model, prompts) -> dict[int, list[int]]:
    gen = BatchGenerator(model, stop_tokens=None)
    try:
        return run_schedule(gen.next_generated, gen.insert, gen.remove, prompts)
    finally:
        gen.close()


def paged_tokens(om, prompts, before_step=None) -> dict[int, list[int]]:
    with BatchDecoder(om) as dec:
        return run_schedule(dec.next, dec.insert, dec.remove, prompts, before_step)


@pytest.fixture(scope="module")
def stock_runs(tiny_dirs):
    runs = {}
    for fam, path in tiny_dirs.items():
        model, tok = stock_load(str(path))
        prompts = [tok.encode(t) for t in TEXTS]
        runs[fam] = (prompts, stock_tokens(model, prompts))
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_stock_batch_generator_with_joins_and_a_leave(family, tiny_dirs, stock_runs):
    prompts, expected = stock_runs[family]
    assert len(expected[2]) < MAX_TOKENS[2]  # the removed sequence stopped early: the schedule did remove it
    assert [len(expected[i]) for i in (0, 1, 3, 4)] == [MAX_TOKENS[i] for i in (0, 1, 3, 4)]
    for budget in BUDGETS:
        om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget=budget))
        try:
            got = paged_tokens(om, prompts)
            assert got == expected, (family, budget)
            assert om.cache.stats()  # the model paged through its cache
            if budget == "25%":
                assert om.counters()["misses"] > 0  # experts were read during the batch, not all resident
            assert all(int(om.cache.table.layers[l].pins.sum()) == 0 for l in om.moe_layers)  # nothing held after close
        finally:
            om.close()


EVENT = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.tuples(st.lists(st.integers(1, 300), min_size=1, max_size=24),
                                                    st.integers(1, 9)), min_size=1, max_size=3)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("step"), st.integers(1, 3)))


def run_events(next_step, insert, remove, events, shrink=None) -> dict[int, list[int]]:
    """Play a schedule (inserts, removals of the n-th inserted sequence, steps, and with `shrink` governor
    requests: ("shrink", n) calls shrink(n)), then step to the end."""
    uids, out = [], {}
    for kind, arg in events:
        if kind == "insert":
            for uid in insert([p for p, _ in arg], [m for _, m in arg]):
                uids.append(uid)
                out[uid] = []
        elif kind == "remove":
            if arg < len(uids):
                remove([uids[arg]])
        elif kind == "shrink":
            shrink(arg)
        else:
            for _ in range(arg):
                for r in next_step():
                    out[r.uid].append(r.token)
    while responses := next_step():
        for r in responses:
            out[r.uid].append(r.token)
    return out


@pytest.fixture(scope="module")
def squeezed_qwen(tiny_dirs):
    stock, _ = stock_load(str(tiny_dirs["qwen3_moe"]))
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    yield stock, om
    om.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(EVENT, min_size=1, max_size=8))
def test_random_schedules_equal_stock(events, squeezed_qwen):
    """Random joins, leaves and steps (prompts of 1-24 tokens, 1-9 tokens each) at 25%: stock's tokens."""
    stock, om = squeezed_qwen
    gen = BatchGenerator(stock, stop_tokens=None)
    try:
        expected = run_events(gen.next_generated, gen.insert, gen.remove, events)
    finally:
        gen.close()
    with BatchDecoder(om) as dec:
        assert run_events(dec.next, dec.insert, dec.remove, events) == expected


@pytest.mark.long
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_stock_at_the_minimum_budget(family, tiny_dirs, stock_runs):
    """The smallest budget that runs (top-k slots per layer): every batched step's union exceeds the slots."""
    prompts, expected = stock_runs[family]
    probe = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    minimum = probe.plan.min_bytes
    probe.close()
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget=f"{minimum}B"))
    try:
        assert all(om.cache.usable_slots(l) == om.top_k for l in om.moe_layers)
        assert paged_tokens(om, prompts) == expected
    finally:
        om.close()


def test_a_wrong_slot_for_the_other_sequences_is_caught(tiny_dirs, stock_runs, monkeypatch):
    """Planted mutation: a batched call maps every token's experts through the first token's slots."""
    prompts, expected = stock_runs["qwen3_moe"]
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        right = om.cache.slot_ids
        batched_calls = []

        def first_rows_slots(layer, expert_ids):
            slots = np.array(right(layer, expert_ids))
            flat = slots.reshape(-1, slots.shape[-1])
            if flat.shape[0] > 1:
                batched_calls.append(layer)
                flat[1:] = flat[0]
            return slots

        monkeypatch.setattr(om.cache, "slot_ids", first_rows_slots)
        got = paged_tokens(om, prompts)
        assert batched_calls  # the mutation was on the path the batch takes
        assert got != expected
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_cache_shrinking_mid_batch_keeps_the_tokens(family, tiny_dirs, stock_runs):
    """Memory pressure: the governor's request for the minimum slots (top-k per layer) lands after step 3, while
    four sequences decode; their union no longer fits a layer's slots and runs expert-major. Same tokens."""
    prompts, expected = stock_runs[family]
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="50%"))
    try:
        def squeeze(step):
            if step == 3:
                om.cache.request_usable_slots(om.top_k)

        assert paged_tokens(om, prompts, squeeze) == expected
        assert all(om.cache.usable_slots(l) == om.top_k for l in om.moe_layers)
        assert om.cache.resize_stats.n_shrinks > 0
    finally:
        om.close()


def test_identical_prompts_read_one_sequences_experts(tiny_dirs):
    """B copies of one prompt route identically: each step's union is k per MoE layer, the sum B * k."""
    om = OffloadedModel.load(tiny_dirs["mixtral"], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(TEXTS[0])
        steps = []
        with BatchDecoder(om, on_step=steps.append) as dec:
            dec.insert([ids] * 4, [6] * 4)
            assert dec.next() and dec.n_active == 4
            while dec.next():
                pass
            assert dec.n_active == 0
        n_layers, k = len(om.moe_layers), om.top_k
        assert steps and all(s.n_sequences == 4 for s in steps)
        assert all(s.unique_experts == n_layers * k and s.summed_experts == 4 * n_layers * k for s in steps)
        assert dec.totals.unique_share == pytest.approx(0.25)
    finally:
        om.close()


def test_batch_generate_equals_mlx_lm_batch_generate(tiny_dirs):
    path = tiny_dirs["qwen3_next"]
    model, tok = stock_load(str(path))
    limits = [9, 4, 11, 7]
    ref = stock_batch_generate(model, tok, [tok.encode(t) for t in TEXTS[:4]], max_tokens=limits,
                               return_token_ids=True, return_logprobs=True)
    with load(path, budget="25%", memory_limit=None) as engine:
        r = batch_generate(engine, TEXTS[:4], max_tokens=limits, return_token_ids=True, return_logprobs=True)
    assert r.token_ids == ref.token_ids and r.texts == ref.texts
    assert r.logprobs == ref.logprobs
    assert r.finish_reasons == ["length"] * 4
    assert r.stats.generation_tokens == sum(limits)
    assert 0 < r.experts.unique_experts <= r.experts.summed_experts


def test_batch_generate_with_a_smaller_batch_than_prompts(tiny_dirs):
    """Five prompts, at most two decoding at once: the others wait and join as sequences finish (mlx-lm's
    continuous batching), at a 25% budget; the same tokens as mlx-lm's batch_generate with the same sizes."""
    path = tiny_dirs["gpt_oss"]
    model, tok = stock_load(str(path))
    sizes = dict(completion_batch_size=2, prefill_batch_size=2)
    ref = stock_batch_generate(model, tok, [tok.encode(t) for t in TEXTS], max_tokens=MAX_TOKENS,
                               return_token_ids=True, **sizes)
    with load(path, budget="25%", memory_limit=None) as engine:
        r = batch_generate(engine, TEXTS, max_tokens=MAX_TOKENS, return_token_ids=True, **sizes)
    assert r.token_ids == ref.token_ids
    assert r.experts.steps > max(MAX_TOKENS)  # not all five at once


def test_batch_generate_refuses_bad_input(tiny_dirs, tmp_path):
    with load(tiny_dirs["qwen3_moe"], budget="50%", memory_limit=None) as engine:
        with pytest.raises(ValueError, match="prompts is empty"):
            batch_generate(engine, [])
        with pytest.raises(ValueError, match="one per prompt"):
            batch_generate(engine, ["a", "b"], max_tokens=[3])
        with pytest.raises(ValueError, match="max_tokens\\[1\\] = 0"):
            batch_generate(engine, ["a", "b"], max_tokens=[3, 0])
        with pytest.raises(ValueError, match="empty after tokenization"):
            batch_generate(engine, [[1, 2], []])
        engine.draft = object()  # as load(draft=...) sets it
        with pytest.raises(ValueError, match="with a drafter"):
            batch_generate(engine, ["a"])
