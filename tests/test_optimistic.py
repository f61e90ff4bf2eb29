"""One-sync verify (runtime/optimistic.py): same logits and bookkeeping as the normal path when the
experts are resident, a clean fallback when one is not, and lossless speculative decoding either way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from runtime.offloaded_model import OffloadConfig, OffloadedModel
from runtime.optimistic import OptimismGate, OptimisticPass
from runtime.spec_run import run_speculative
from storage import ExpertKey
from runtime.tiny_checkpoint import make_tiny
from tests.conftest import PROMPT, TINY, greedy_ids

N = 20


def _routing_recorder(om):
    seen = {}
    om.set_observer(lambda layer, ids: seen.setdefault(layer, []).append(ids.copy()))
    return seen


def test_resident_window_gives_the_normal_logits_and_bookkeeping(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-4])[None], cache=cache))
        window = mx.array(ids[-4:])[None]
        mx.eval(om.model(window, cache=cache))  # loads the window's experts
        for c in cache:
            c.trim(4)

        before = om.counters()
        seen = _routing_recorder(om)
        normal = om.model(window, cache=cache)
        mx.eval(normal)
        normal_counts = {k: om.counters()[k] - before[k] for k in ("hits", "misses", "bytes_read")}
        normal_seen = seen.copy()
        for c in cache:
            c.trim(4)

        before = om.counters()
        seen = _routing_recorder(om)
        optimistic = OptimisticPass(om).run(lambda: om.model(window, cache=cache))
        assert optimistic is not None
        assert mx.array_equal(optimistic, normal).item()  # bit-identical, not merely close
        assert {k: om.counters()[k] - before[k] for k in normal_counts} == normal_counts
        assert normal_counts["misses"] == 0 and normal_counts["hits"] > 0
        assert seen.keys() == normal_seen.keys()
        for layer in seen:
            assert all(np.array_equal(a, b) for a, b in zip(seen[layer], normal_seen[layer]))
        assert all((ls.pins == 0).all() for ls in om.cache.table.layers.values())
    finally:
        om.close()


def test_an_absent_expert_discards_the_pass_and_records_nothing(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        seen = _routing_recorder(om)
        before = om.counters()
        opt = OptimisticPass(om)
        assert opt.run(lambda: om.model(mx.array(ids[:4])[None], cache=cache)) is None  # the cache is empty
        assert om.counters() == before and not seen
        assert (opt.stats.tries, opt.stats.fallbacks) == (1, 1)
        assert all((ls.pins == 0).all() for ls in om.cache.table.layers.values())
        assert all(m.optimistic is None for m in om.modules.values())
    finally:
        om.close()


def test_a_frozen_slot_is_never_evicted_by_prefetch(packed_dirs):
    om = OffloadedModel.load(packed_dirs["qwen3_moe"], OffloadConfig(budget="25%", threads=1))
    try:
        layer = om.moe_layers[0]
        n_slots = om.cache.n_slots(layer)
        om.cache.prefetch([ExpertKey(layer, e) for e in range(n_slots)], round_id=1)
        om.loader.drain()
        om.cache.unprotect()
        frozen = om.cache.freeze_resident()
        table, pinned = frozen[layer]
        assert sorted(np.flatnonzero(table >= 0).tolist()) == list(range(n_slots))
        om.cache.prefetch([ExpertKey(layer, e) for e in range(n_slots, 2 * n_slots)], round_id=2)
        om.loader.drain()
        ls = om.cache.table.layers[layer]
        assert all(ls.slot_to_expert[table[e]] == e for e in range(n_slots))  # nothing was evicted
        om.cache.unprotect()
        om.cache.thaw(frozen)
        assert (ls.pins == 0).all()
    finally:
        om.close()


def test_gate_backs_off_after_fallbacks_and_probes():
    gate = OptimismGate(probe_every=4, window=4)
    for _ in range(4):
        assert gate.should_try()
        gate.record(False)
    tries = [gate.should_try() for _ in range(8)]
    assert tries == [False, False, False, True] * 2
    gate.record(True), gate.record(True), gate.record(True)
    assert gate.should_try()  # 3 of the last 4 succeeded


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("label", ["100%", "50%", "min"])
def test_speculative_greedy_with_one_sync_verify_is_lossless(family, label, tiny_dirs, random_drafter):
    path = tiny_dirs[family]
    budget = label
    if label == "min":
        probe = OffloadedModel.load(path, OffloadConfig(budget="100%"))
        budget = f"{probe.plan.min_bytes}B"
        probe.close()
    om = OffloadedModel.load(path, OffloadConfig(budget=budget))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        related = load(str(path))[0], om.config  # the target itself, resident: every draft accepted
        fallbacks = 0
        for predictor in ("oracle", "none"):
            for name, (dmodel, dconfig) in {"related": related, "random": random_drafter}.items():
                tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor=predictor,
                                                   cutoff=None, draft_model=dmodel, draft_config=dconfig,
                                                   optimistic="on")
                assert tokens == expected, f"{family} {label} {predictor} {name}"
                assert stats.optimistic_tries == stats.n_rounds
                fallbacks += stats.optimistic_fallbacks
                if predictor == "oracle" and label != "min":
                    assert stats.optimistic_fallbacks < stats.optimistic_tries  # passes did succeed
        if label == "min":  # a window needs more experts than the minimum budget holds
            assert fallbacks > 0
    finally:
        om.close()
