"""One-sync verify (runtime/decode/one_sync.py): same logits and bookkeeping as the normal path when the
experts are resident, a clean fallback when one is not, and lossless speculative decoding either way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.one_sync import OneSyncGate, OneSyncPass
from runtime.decode.speculative_run import run_speculative
from storage import ExpertKey
from runtime.checkpoints.tiny import make_tiny
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
        one_sync = OneSyncPass(om).run(lambda: om.model(window, cache=cache))
        assert one_sync is not None
        assert mx.array_equal(one_sync, normal).item()  # bit-identical, not merely close
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
        opt = OneSyncPass(om)
        assert opt.run(lambda: om.model(mx.array(ids[:4])[None], cache=cache)) is None  # the cache is empty
        assert om.counters() == before and not seen
        assert (opt.stats.tries, opt.stats.fallbacks) == (1, 1)
        assert all((ls.pins == 0).all() for ls in om.cache.table.layers.values())
        assert all(m.one_sync is None for m in om.modules.values())
    finally:
        om.close()


def test_a_pending_resize_takes_effect_in_a_one_sync_pass(tiny_dirs):
    """The memory governor's requests apply at a layer's next call; one-sync passes are calls too."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids)[None], cache=cache))
        om.cache.request_usable_slots(om.top_k * 2)
        OneSyncPass(om).run(lambda: om.model(mx.array(ids[-1:])[None], cache=cache))
        for layer, ls in om.cache.table.layers.items():
            assert ls.usable == om.top_k * 2
            assert om.cache.table.valid_count(layer) <= om.top_k * 2
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


def _drive(gate: OneSyncGate, outcomes, ms: dict) -> list[bool]:
    """Feed the gate as gated_forward does; returns, per call, whether a pass was tried."""
    tried = []
    for success in outcomes:
        t = gate.should_try()
        tried.append(t)
        if t:
            gate.record(success, ms["pass"] if success else ms["fail"])
        if not (t and success):
            gate.record_normal(ms["normal"])
    return tried


def test_gate_tries_when_the_measured_saving_outweighs_the_failures():
    outcomes = [i % 5 != 0 for i in range(400)]  # 80% of passes would succeed
    cpu = {"normal": 6.2, "pass": 5.4, "fail": 5.4}  # host syncs are cheap: a failure costs 7 successes
    metal = {"normal": 60.0, "pass": 16.0, "fail": 16.0}  # syncs dominate a forward
    assert sum(_drive(OneSyncGate(), outcomes, cpu)) < 60
    assert sum(_drive(OneSyncGate(), outcomes, metal)) == len(outcomes)
    assert all(_drive(OneSyncGate(min_success=0.0), outcomes, cpu))  # "on": always


def test_gate_probes_with_a_doubling_gap_and_recovers():
    gate = OneSyncGate(probe_every=4, max_probe_every=16, window=4)
    ms = {"normal": 6.0, "pass": 5.0, "fail": 5.0}
    tried = _drive(gate, [False] * 80, ms)
    probes = [i for i, t in enumerate(tried) if t][4:]  # after the first `window` tries
    assert [b - a for a, b in zip(probes, probes[1:])] == [8, 16, 16, 16, 16]
    assert probes[0] == 3 + 4
    tried = _drive(gate, [True] * 60, {"normal": 60.0, "pass": 16.0, "fail": 16.0})
    assert all(tried[-20:])  # probes succeed, the gate trusts the pass again


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("budget", ["100%", "50%"])
def test_plain_decoding_with_one_sync_steps_is_lossless(family, budget, tiny_dirs):
    from runtime.decode.plain import generate_tokens

    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget=budget))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(load(str(tiny_dirs[family]))[0], ids, 40)
        tokens, stats = generate_tokens(om.model, ids, max_tokens=40, om=om, one_sync="on")
        assert tokens == expected
        assert stats.one_sync_tries >= 39  # every single-token step (generate_step also runs one ahead)
        if budget == "100%":  # once the experts are in, steps succeed
            assert stats.one_sync_fallbacks < stats.one_sync_tries
        assert all(m.one_sync is None for m in om.modules.values())
        off, _ = generate_tokens(om.model, ids, max_tokens=40, om=om, one_sync="off")
        assert off == expected
    finally:
        om.close()


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
                                                   one_sync="on")
                assert tokens == expected, f"{family} {label} {predictor} {name}"
                assert stats.one_sync_tries == stats.n_rounds
                fallbacks += stats.one_sync_fallbacks
                if predictor == "oracle" and label != "min":
                    assert stats.one_sync_fallbacks < stats.one_sync_tries  # passes did succeed
        if label == "min":  # a window needs more experts than the minimum budget holds
            assert fallbacks > 0
    finally:
        om.close()
