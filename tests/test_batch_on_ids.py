"""A batch step at a full budget runs its MoE layers on the routed ids (runtime/decode/batch_pass.py): one host sync.

- Every family at 100%: the tokens equal stock mlx-lm's BatchGenerator with joins and a leave (the schedule of
  tests/test_batch_generate.py), and each decode step makes exactly one host sync (mlx-lm's token read-back) where
  the per-layer path makes one per MoE layer more -- counted by BatchStepStats.host_syncs, not timed.
- Random schedules of joins, leaves, steps and governor requests from 100% equal stock (hypothesis).
- A shrink between steps (the governor's request) and one applied in the middle of a step's build (after its first
  MoE layer ran on its ids) keep the tokens: the built layers' slots are held until the step is evaluated, the
  layers after the shrink take the synced path. Planted: without the hold, the mid-build shrink frees the slots
  the built layer reads (their pages given back: zeros) and the tokens change.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator
from test_batch_generate import run_events, run_schedule, stock_runs  # noqa: F401 (stock_runs: the fixture)

from runtime.cache.slot_table import VALID
from runtime.checkpoints.tiny import FAMILIES
from runtime.decode.batch import BatchDecoder
from runtime.decode.batch_pass import BatchPass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel


def _run(om, prompts, before_step=None, on_ids=True):
    steps = []
    with BatchDecoder(om, on_step=steps.append, on_ids=on_ids) as dec:
        got = run_schedule(dec.next, dec.insert, dec.remove, prompts, before_step)
    assert all(int(om.cache.table.layers[l].held) == 0 for l in om.moe_layers)  # every hold released
    assert all(int(om.cache.table.layers[l].pins.sum()) == 0 for l in om.moe_layers)
    return got, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_one_host_sync_per_step_at_a_full_budget_and_stock_tokens(family, tiny_dirs, stock_runs):
    prompts, expected = stock_runs[family]
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        got, steps = _run(om, prompts)
        assert got == expected
        assert steps and all(s.host_syncs == 1 for s in steps)  # the token read-back only
        assert all(0 < s.unique_experts <= s.summed_experts for s in steps)  # routing still counted (after the step)
        assert om.counters()["hits"] > 0  # and booked with the cache
        per_layer, synced = _run(om, prompts, on_ids=False)
        assert per_layer == expected
        assert all(s.host_syncs == len(om.moe_layers) + 1 for s in synced)
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "deepseek_v3", "gpt_oss"])
def test_a_shrink_between_steps_keeps_the_tokens(family, tiny_dirs, stock_runs):
    """The governor's request for the minimum lands after step 3 while a step built on ids is pending (held)."""
    prompts, expected = stock_runs[family]
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        def squeeze(step):
            if step == 3:
                om.cache.request_usable_slots(om.top_k)

        got, steps = _run(om, prompts, squeeze)
        assert got == expected
        assert steps[0].host_syncs == 1 and steps[-1].host_syncs > 1  # on ids before, synced after
        assert all(om.cache.usable_slots(l) == om.top_k for l in om.moe_layers)
    finally:
        om.close()


def _shrink_mid_build(om, monkeypatch, at_step: int = 3):
    """After the first MoE layer of decode step `at_step` was built on its ids: shrink every layer to top-k now."""
    first = om.moe_layers[0]
    seen = {"steps": 0}
    record = BatchPass.record

    def shrinking_record(self, layer, indices, slots):
        record(self, layer, indices, slots)
        if layer == first:
            seen["steps"] += 1
            if seen["steps"] == at_step:
                om.cache.set_usable_slots(om.top_k)
                ls = om.cache.table.layers[first]  # what the built layer may still read: kept only under a hold
                seen["kept"] = int((ls.state[ls.usable:] == VALID).sum())

    monkeypatch.setattr(BatchPass, "record", shrinking_record)
    return seen


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_shrink_in_the_middle_of_a_step_keeps_the_tokens_and_a_missing_hold_is_caught(family, tiny_dirs,
                                                                                       stock_runs, monkeypatch):
    prompts, expected = stock_runs[family]
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        seen = _shrink_mid_build(om, monkeypatch)
        got, steps = _run(om, prompts)
        assert seen["steps"] >= 3 and om.cache.resize_stats.n_shrinks > 0
        assert seen["kept"] > 0  # the held layer's experts beyond the new range wait for the step's release
        assert got == expected
    finally:
        om.close()

    # Planted: the step is built unheld. The shrink then evicts the experts the built layer reads at once; whether
    # the tokens change depends on whether their rows are overwritten or their pages given back before the step
    # runs (timing and page alignment), so the eviction itself is what is checked.
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        seen = _shrink_mid_build(om, monkeypatch)
        monkeypatch.setattr(om.cache, "hold", lambda layers=None: None)
        monkeypatch.setattr(om.cache, "release", lambda layers=None: None)
        with BatchDecoder(om) as dec:
            run_schedule(dec.next, dec.insert, dec.remove, prompts)
        assert seen["kept"] == 0
    finally:
        om.close()


SHRINK_EVENT = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.tuples(st.lists(st.integers(1, 300), min_size=1, max_size=24),
                                                    st.integers(1, 9)), min_size=1, max_size=3)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("shrink"), st.integers(4, 32)))


@pytest.fixture(scope="module")
def stock_qwen(tiny_dirs):
    from mlx_lm import load as stock_load

    return stock_load(str(tiny_dirs["qwen3_moe"]))[0]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(SHRINK_EVENT, min_size=1, max_size=10))
def test_random_schedules_with_shrinks_at_a_full_budget_equal_stock(events, tiny_dirs, stock_qwen):
    """Random joins, leaves, steps and governor requests (applied at a layer's next call, as the memory governor's),
    starting at 100%: steps on ids until a layer shrinks, synced after; stock's tokens throughout."""
    gen = BatchGenerator(stock_qwen, stop_tokens=None)
    try:
        expected = run_events(gen.next_generated, gen.insert, gen.remove, events, lambda n: None)
    finally:
        gen.close()
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        with BatchDecoder(om) as dec:
            got = run_events(dec.next, dec.insert, dec.remove, events, om.cache.request_usable_slots)
        assert got == expected
        assert all(int(om.cache.table.layers[l].held) == 0 for l in om.moe_layers)
    finally:
        om.close()
