"""Device passes (runtime/decode/device_pass.py): expert lookups on the device, one host sync per forward,
the normal path's logits and bookkeeping when the experts are resident, a repair from the first layer that
missed when one is not, no slot a pending forward reads ever overwritten, and lossless decoding either way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import run_speculative
from storage import ExpertKey
from runtime.checkpoints.tiny import make_tiny
from tests.conftest import PROMPT, TINY, greedy_ids
from tests.pass_helpers import pass_idle as _idle

N = 20


def _routing_recorder(om):
    seen = {}
    om.set_observer(lambda layer, ids: seen.setdefault(layer, []).append(ids.copy()))
    return seen




def _normal_window_logits(path, budget, ids, n):
    """The synced path's logits for the last n tokens of ids, from a fresh model (reference)."""
    om = OffloadedModel.load(path, OffloadConfig(budget=budget))
    try:
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-n])[None], cache=cache))
        out = om.model(mx.array(ids[-n:])[None], cache=cache)
        mx.eval(out)
        return out
    finally:
        om.close()


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
        syncs = om.cache.host_syncs
        seen = _routing_recorder(om)
        dp = DevicePass(om)
        device = dp.run(lambda: om.model(window, cache=cache), cache, 4)
        assert mx.array_equal(device, normal).item()  # bit-identical, not merely close
        assert om.cache.host_syncs - syncs == 1 and (dp.stats.host_syncs, dp.stats.repairs) == (1, 0)
        assert {k: om.counters()[k] - before[k] for k in normal_counts} == normal_counts
        assert normal_counts["misses"] == 0 and normal_counts["hits"] > 0
        assert seen.keys() == normal_seen.keys()
        for layer in seen:
            assert all(np.array_equal(a, b) for a, b in zip(seen[layer], normal_seen[layer]))
        assert _idle(om)
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_an_absent_expert_is_repaired_not_discarded(family, tiny_dirs):
    """An empty cache: every layer misses; the pass reads what was flagged and recomputes."""
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-4])[None], cache=cache))
        before = om.counters()
        dp = DevicePass(om)
        out = dp.run(lambda: om.model(mx.array(ids[-4:])[None], cache=cache), cache, 4)
        assert mx.array_equal(out, _normal_window_logits(path, "50%", ids, 4)).item()
        assert dp.stats.repairs >= 1 and dp.stats.host_syncs == 1 + dp.stats.repairs
        assert om.counters()["misses"] > before["misses"]
        assert _idle(om)
        # The state after the repaired window is the normal path's: the next token's logits agree.
        nxt = om.model(mx.array(ids[-1:])[None], cache=cache)
        ref = OffloadedModel.load(path, OffloadConfig(budget="100%"))
        try:
            rc = make_prompt_cache(ref.model)
            mx.eval(ref.model(mx.array(ids)[None], cache=rc))
            assert mx.array_equal(nxt, ref.model(mx.array(ids[-1:])[None], cache=rc)).item()
        finally:
            ref.close()
    finally:
        om.close()


def test_a_repair_keeps_the_layers_before_the_first_miss(tiny_dirs):
    """A decode step whose only miss is in the last MoE layer recomputes only that decoder layer."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-1])[None], cache=cache))
        seen = _routing_recorder(om)
        mx.eval(om.model(mx.array(ids[-1:])[None], cache=cache))  # the window's experts are resident
        om.set_observer(None)
        for m in om.modules.values():
            m.release_pending()
        for c in cache:
            c.trim(1)
        last = om.moe_layers[-1]
        window = set(np.unique(seen[last][-1]).tolist())
        others = [e for e in range(TINY["n_experts"]) if e not in window][: om.cache.n_slots(last)]
        om.cache.prefetch([ExpertKey(last, e) for e in others], round_id=1)  # evicts the window's experts
        om.loader.drain()
        om.cache.unprotect()
        assert om.cache.table.layers[last].is_absent(sorted(window)).all()
        dp = DevicePass(om)
        out = dp.run(lambda: om.model(mx.array(ids[-1:])[None], cache=cache), cache, 1)
        assert mx.array_equal(out, _normal_window_logits(path, "50%", ids, 1)).item()
        assert dp.stats.repairs == 1 and dp.stats.recomputed_layers == 1
        assert _idle(om)
    finally:
        om.close()


def test_a_pending_resize_takes_effect_in_a_device_pass(tiny_dirs):
    """The memory governor's requests apply at a layer's next call; device passes are calls too."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids)[None], cache=cache))
        om.cache.request_usable_slots(om.top_k * 2)
        DevicePass(om).run(lambda: om.model(mx.array(ids[-1:])[None], cache=cache), cache, 1)
        for layer, ls in om.cache.table.layers.items():
            assert ls.usable == om.top_k * 2
            assert om.cache.table.valid_count(layer) <= om.top_k * 2
    finally:
        om.close()


def _evicted_while_pending(om, hold: bool) -> int:
    """Launch a device pass, then (while it is pending) prefetch more experts than there are free slots
    and shrink the cache; returns how many experts resident at launch lost their slot before finish()."""
    ids = om.tokenizer.encode(PROMPT)
    cache = make_prompt_cache(om.model)
    mx.eval(om.model(mx.array(ids)[None], cache=cache))
    om.cache.unprotect()
    resident = {l: ls.resident.copy() for l, ls in om.cache.table.layers.items()}
    dp = DevicePass(om)
    if not hold:
        om.cache.hold = om.cache.release = lambda layers=None: None  # a broken pass: no hold
    dp.launch(lambda: om.model(mx.array(ids[-1:])[None], cache=cache), cache, 1)
    absent = [ExpertKey(l, e) for l in om.moe_layers for e in range(TINY["n_experts"]) if resident[l][e] >= om.cache.n_slots(l)]
    om.cache.prefetch(absent, round_id=1)  # only absent experts: nothing resident is protected by it
    om.loader.drain()
    om.cache.set_usable_slots(om.top_k)
    table = om.cache.table.layers
    changed = sum(int(((r < table[l].n_slots) & (table[l].resident != r)).sum()) for l, r in resident.items())
    dp.finish()
    dp.flush()
    return changed


def test_no_slot_a_pending_forward_reads_is_overwritten(packed_dirs):
    om = OffloadedModel.load(packed_dirs["qwen3_moe"], OffloadConfig(budget="50%", threads=1))
    try:
        assert _evicted_while_pending(om, hold=True) == 0
        om.cache.unprotect()
        assert _idle(om)
        # Once released, the shrink and the prefetches proceed.
        assert all(om.cache.table.valid_count(l) <= om.top_k or om.cache.table.layers[l].pins.any()
                   for l in om.moe_layers)
    finally:
        om.close()
    om = OffloadedModel.load(packed_dirs["qwen3_moe"], OffloadConfig(budget="50%", threads=1))
    try:
        assert _evicted_while_pending(om, hold=False) > 0  # what the hold prevents
    finally:
        om.close()


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
        assert stats.one_sync_tries >= 39  # every single-token step
        if budget == "100%":  # warm start: every expert is in before decoding, every step takes one sync
            assert stats.one_sync_fallbacks == 0 and stats.host_syncs_per_token == 1.0
            assert stats.misses_per_token == 0
        assert stats.host_syncs_per_token == pytest.approx(1 + stats.repairs_per_token)
        assert _idle(om)
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
                # Fixed K: every round is a verify window (adaptive K's first round is a probe, with none)
                tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor=predictor,
                                                   cutoff=None, draft_model=dmodel, draft_config=dconfig,
                                                   one_sync="on", adaptive_k=False)
                assert tokens == expected, f"{family} {label} {predictor} {name}"
                assert stats.n_verifies >= 1 and stats.one_sync_tries == stats.n_verifies  # every verify window
                fallbacks += stats.one_sync_fallbacks
                if label != "min":  # every layer looks up on the device: one sync per verify, plus repairs
                    assert stats.host_syncs == stats.n_verifies + stats.repairs
                if label == "100%":  # warm start: every expert resident, one host sync per verify
                    assert stats.host_syncs == stats.n_verifies and stats.repairs == 0
                if predictor == "oracle" and label != "min":
                    assert stats.one_sync_fallbacks < stats.one_sync_tries  # passes did succeed
        if label == "min":  # a window needs more experts than the minimum budget holds
            assert fallbacks > 0
    finally:
        om.close()


def test_warm_start_reads_every_expert_at_a_full_budget_only(tiny_dirs, tmp_path):
    """A full budget reads every expert before decoding; a partial one starts as it is; "off" is a cold start;
    anything else (a file: the removed trace warm start) is refused with the values it takes."""
    from runtime.decode.warm import warm_keys, warm_start

    for budget, expected in (("100%", "all"), ("25%", "none")):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            every = len(om.moe_layers) * TINY["n_experts"]
            assert warm_keys(om, "off") == []
            if expected == "none":
                assert warm_keys(om) == []
                continue
            assert warm_start(om) == every
            om.loader.drain()
            for l in om.moe_layers:
                assert not om.cache.table.layers[l].is_absent(list(range(TINY["n_experts"]))).any()
            with pytest.raises(ValueError, match="expected None .* or 'off'"):
                warm_keys(om, str(tmp_path / "counts.json"))
        finally:
            om.close()


def test_an_early_stop_releases_the_queued_forward(tiny_dirs):
    """Stopped at an eos with the next forward queued: it is finished and released, nothing left pinned or held, at a
    full budget (device passes) and at 50% (the per-layer path)."""
    from runtime.decode.plain import generate_tokens

    for budget in ("100%", "50%"):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            ids = om.tokenizer.encode(PROMPT)
            expected = greedy_ids(load(str(tiny_dirs["qwen3_moe"]))[0], ids, 8)
            tokens, stats = generate_tokens(om.model, ids, max_tokens=8, om=om, eos_ids={expected[3]})
            assert tokens == expected[:4]  # stopped at the eos; the forward queued after it was dropped
            assert _idle(om), budget
            assert stats.decode_path == ("device pass" if budget == "100%" else "per-layer sync")
        finally:
            om.close()
