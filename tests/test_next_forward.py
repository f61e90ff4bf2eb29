"""Building the next forward before the current one's sync (runtime/decode/next_forward.py): at a full
budget every decode forward after the first is built on the previous token's lazy output (mlx-lm's
pipelining) with one host sync per token; when the previous forward needs a repair the early forward is
dropped, its cache writes rolled back (KV trimmed, GatedDeltaNet and sliding-window state restored), and
the tokens still equal stock's."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm import load

import runtime.decode.next_forward as next_forward
from runtime.decode import offloaded_generate_step
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.warm import warm_start
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle as _idle

N = 20


def _decode(om, segment=None, build_next=True, n=N, **options):
    return decode_through_pass(om, n, segment=segment, build_next=build_next, **options)


def _expected(tiny_dirs, family, om):
    return greedy_ids(load(str(tiny_dirs[family]))[0], om.tokenizer.encode(PROMPT), N)


def test_at_a_full_budget_every_forward_is_built_before_the_previous_sync(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        tokens, dp = _decode(om, segment="auto")
        assert tokens == _expected(tiny_dirs, "qwen3_moe", om)
        st = dp.stats
        # Forwards: the prompt's last token, then one per token (the last one after the last yield too); all
        # but the prompt's and the first decode forward were built early, none dropped.
        assert st.passes == N + 1 and st.next_built == N - 1 and st.next_dropped == 0
        assert st.host_syncs == st.passes and st.repairs == 0  # one host sync per token
        assert _idle(om)
    finally:
        om.close()


def test_off_builds_after_the_sync_with_the_same_tokens(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        tokens, dp = _decode(om, build_next=False)
        assert tokens == _expected(tiny_dirs, "qwen3_moe", om) and dp.stats.next_built == 0
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_a_dropped_next_forward_leaves_the_caches_right(family, tiny_dirs, monkeypatch):
    """Built even while repairs are frequent (the rate gate lifted): every repaired forward drops the next one,
    whose KV (trimmed), GatedDeltaNet state (qwen3_next) or full sliding window (gpt_oss, window 8 of a
    longer sequence: restored from the snapshot) must come back as the repaired forward left them."""
    monkeypatch.setattr(next_forward, "NEXT_MAX_REPAIR_RATE", math.inf)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        tokens, dp = _decode(om)
        assert tokens == _expected(tiny_dirs, family, om)
        st = dp.stats
        assert st.next_dropped > 0  # the early forward was dropped (and the tokens stayed right)
        assert st.host_syncs == st.passes + st.repairs  # a dropped forward made no sync
        assert _idle(om)
    finally:
        om.close()


def test_a_dropped_forward_without_its_rollback_is_caught(tiny_dirs, monkeypatch):
    """The test above can fail: keep the dropped forward's cache writes and the tokens differ (or the run breaks)."""
    monkeypatch.setattr(next_forward, "NEXT_MAX_REPAIR_RATE", math.inf)
    monkeypatch.setattr(next_forward, "roll_back", lambda *a, **k: None)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        expected = _expected(tiny_dirs, "qwen3_moe", om)
        try:
            tokens, dp = _decode(om)
        except Exception:
            return
        assert dp.stats.next_dropped > 0
        assert tokens != expected
    finally:
        om.close()


def test_routed_forwards_synced_as_built_or_hooks_that_may_evict_build_no_next_forward(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        # Routed forwards that sync as they are built (staged ones build their next forward a layer at a time
        # between their route syncs: tests/test_paced_build.py).
        tokens, dp = _decode(om, segment="auto", staged=False)
        assert tokens == _expected(tiny_dirs, "qwen3_moe", om)
        # The first repairs make the layers routed; forwards synced as they are built have no next one built early.
        assert dp.stats.repairs > 0 and dp.stats.routed > 0
        assert dp.stats.next_built <= dp.stats.passes - dp.stats.routed
    finally:
        om.close()
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        om.forward_hooks.append(lambda routing: None)  # a forecaster's hook may evict: no pending graph allowed
        tokens, dp = _decode(om)
        assert dp.stats.next_built == 0 and tokens == _expected(tiny_dirs, "qwen3_moe", om)
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_while_repairs_are_frequent_one_sync_next_forwards_are_queued_only_once_accepted(family, tiny_dirs,
                                                                                        monkeypatch):
    """"on" at 25% repairs often: the next forward is still built before the pending one's sync, but queued only
    when the pending one is accepted (a repair then throws away its build, never its compute); lossless."""
    queued = []
    real = DevicePass._build

    def build(self, forward, cache, n_tokens, snapshot, route, queue=True):
        if self._launch is not None:  # built while a forward is pending: a next forward
            queued.append((queue, self.repair_rate))
        return real(self, forward, cache, n_tokens, snapshot, route, queue)

    monkeypatch.setattr(DevicePass, "_build", build)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        tokens, dp = _decode(om, segment=None)
        assert tokens == _expected(tiny_dirs, family, om)
        st = dp.stats
        assert st.repairs > 0 and st.next_built >= N // 2 and 0 < st.next_dropped <= st.repairs
        late = [q for q, rate in queued if rate > next_forward.NEXT_MAX_REPAIR_RATE]
        assert late and not any(late)  # built, not queued, while the rate is over the gate
        assert _idle(om)
    finally:
        om.close()


def test_generation_stats_report_early_and_routed_forwards(tiny_dirs):
    """--json's GenerationStats: early forwards at a full budget, routed ones at 25% (auto), built early too
    (staged: a layer at a time between the pending forward's route syncs)."""
    from runtime.decode.plain import generate_tokens

    for budget, routed in (("100%", False), ("25%", True)):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            ids = om.tokenizer.encode(PROMPT)
            tokens, stats = generate_tokens(om.model, ids, max_tokens=N, om=om)
            assert tokens == _expected(tiny_dirs, "qwen3_moe", om)
            assert stats.early_forwards >= (N // 2 if routed else N - 2)
            assert (stats.routed_forwards >= N // 2) == routed and (stats.routed_forwards == 0) == (not routed)
        finally:
            om.close()


def test_the_build_that_quantizes_the_kv_is_not_built_early(tmp_path, monkeypatch):
    """--kv-bits: the forward whose build converts the caches (mlx-lm's maybe_quantize_kv_cache) waits for the
    previous sync (a drop would leave the repaired forward reading quantized keys); the tokens equal
    generate_step's with the same kv_bits, also when every early forward is dropped."""
    from mlx_lm.generate import generate_step

    from runtime.checkpoints.tiny import make_tiny

    monkeypatch.setattr(next_forward, "NEXT_MAX_REPAIR_RATE", math.inf)
    path = make_tiny(tmp_path / "m", "qwen3_moe", seed=1, layers=3, n_experts=32, top_k=4, hidden=128)  # head_dim 32
    for budget in ("100%", "25%"):
        om = OffloadedModel.load(path, OffloadConfig(budget=budget))
        try:
            ids = om.tokenizer.encode(PROMPT)
            start = len(ids) + 5  # converts in the middle of decoding
            stock = [t for t, _ in generate_step(mx.array(ids), load(str(path))[0], max_tokens=N, kv_bits=4,
                                                 kv_group_size=32, quantized_kv_start=start)]
            warm_start(om)
            dp = DevicePass(om, segment=None)
            gen = offloaded_generate_step(om, mx.array(ids), max_tokens=N, sampler=lambda x: mx.argmax(x, axis=-1),
                                          device_pass=dp, after_prefill=om.cache.settle_inflight, kv_bits=4,
                                          kv_group_size=32, quantized_kv_start=start)
            assert [t for t, _ in gen] == stock
            assert 0 < dp.stats.next_built < N - 1  # built early except around the conversion
        finally:
            om.close()


def _fail_layer_call(monkeypatch, om, layer_index: int, after: int) -> list:
    """Make decoder layer `layer_index` raise on its call number `after` + 1 (and later ones): a build that fails
    midway, after the layers before it wrote their caches. Returns the call counter."""
    layer = om.model.layers[layer_index]
    real, calls = type(layer).__call__, [0]

    def call(self, *args, **kwargs):
        if self is layer:
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError("injected: a layer's build failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(layer), "__call__", call)
    return calls


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_next_forward_whose_build_raises_midway_leaves_the_caches_as_the_pending_forward_left_them(
        family, tiny_dirs, monkeypatch):
    """At 100% every forward after the first is built before the previous one's sync. The next forward's build
    raises in its second decoder layer: the error reaches the caller, and the first layer's cache, which that
    build had written, is rolled back -- every layer holds the prompt and the tokens decoded, as a retry needs."""
    from mlx_lm.models.cache import make_prompt_cache

    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        warm_start(om)
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        dp = DevicePass(om)
        # prefill (1 call of layer 1), the prompt's last token (2), decode forwards 3, 4: the 4th call is the first
        # next forward built early; it fails at call 5, the next forward after that one
        _fail_layer_call(monkeypatch, om, 1, after=4)
        gen = offloaded_generate_step(om, mx.array(ids), max_tokens=N, sampler=lambda x: mx.argmax(x, axis=-1),
                                      device_pass=dp, prompt_cache=cache, after_prefill=om.cache.settle_inflight)
        emitted = []
        with pytest.raises(RuntimeError, match="injected"):
            for t, _ in gen:
                emitted.append(t)
        assert dp.stats.next_built >= 1
        offsets = [c.offset for c in cache if c.is_trimmable()]
        assert len(set(offsets)) == 1, offsets  # layer 0 was written by the failed build, then rolled back
        assert offsets[0] in (len(ids) + len(emitted) - 1, len(ids) + len(emitted))
    finally:
        om.close()
