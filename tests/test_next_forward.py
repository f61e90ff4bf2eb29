"""Building the next forward before the current one's sync (runtime/decode/next_forward.py): at a full
budget every decode forward after the first is built on the previous token's lazy output (mlx-lm's
pipelining) with one host sync per token; when the previous forward needs a repair the early forward is
dropped, its cache writes rolled back (KV trimmed, GatedDeltaNet and sliding-window state restored), and
the tokens still equal stock's."""

from __future__ import annotations

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


def _decode(om, build_next=True, n=N, **options):
    return decode_through_pass(om, n, build_next=build_next, **options)


def _expected(tiny_dirs, family, om):
    return greedy_ids(load(str(tiny_dirs[family]))[0], om.tokenizer.encode(PROMPT), N)


def test_at_a_full_budget_every_forward_is_built_before_the_previous_sync(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        tokens, dp = _decode(om)
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
    """Device passes at 25% (as one_sync="on" runs them): every repaired forward drops the next one,
    whose KV (trimmed), GatedDeltaNet state (qwen3_next) or full sliding window (gpt_oss, window 8 of a
    longer sequence: restored from the snapshot) must come back as the repaired forward left them."""
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


def test_generation_stats_report_early_forwards_and_the_decode_path(tiny_dirs):
    """--json's GenerationStats: at a full budget the default decodes through device passes, every forward after the
    first built early, one sync a token; at 25% it takes the per-layer path, one sync per MoE layer and the token's."""
    from runtime.decode.plain import generate_tokens

    for budget in ("100%", "25%"):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            tokens, stats = generate_tokens(om.model, om.tokenizer.encode(PROMPT), max_tokens=N, om=om)
            assert tokens == _expected(tiny_dirs, "qwen3_moe", om)
            if budget == "100%":
                assert stats.decode_path == "device pass" and stats.early_forwards >= N - 2
                assert stats.host_syncs_per_token == 1.0
            else:
                assert stats.decode_path == "per-layer sync" and stats.early_forwards == 0
                assert stats.host_syncs_per_token == len(om.moe_layers) + 1
        finally:
            om.close()


def test_the_build_that_quantizes_the_kv_is_not_built_early(tmp_path, monkeypatch):
    """--kv-bits: the forward whose build converts the caches (mlx-lm's maybe_quantize_kv_cache) waits for the
    previous sync (a drop would leave the repaired forward reading quantized keys); the tokens equal
    generate_step's with the same kv_bits, also when every early forward is dropped."""
    from mlx_lm.generate import generate_step

    from runtime.checkpoints.tiny import make_tiny

    path = make_tiny(tmp_path / "m", "qwen3_moe", seed=1, layers=3, n_experts=32, top_k=4, hidden=128)  # head_dim 32
    for budget in ("100%", "25%"):
        om = OffloadedModel.load(path, OffloadConfig(budget=budget))
        try:
            ids = om.tokenizer.encode(PROMPT)
            start = len(ids) + 5  # converts in the middle of decoding
            stock = [t for t, _ in generate_step(mx.array(ids), load(str(path))[0], max_tokens=N, kv_bits=4,
                                                 kv_group_size=32, quantized_kv_start=start)]
            warm_start(om)
            dp = DevicePass(om)
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
