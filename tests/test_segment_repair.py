"""Segment repairs (runtime/decode/segment_repair.py): a device pass that also syncs at segment boundaries
repairs a miss inside the forward, recomputing only the segment's layers from the first one that missed;
decoding stays lossless (KV caches and GatedDeltaNet state rolled back), every host sync is counted, and
"auto" with routes off cuts a forward into segments only while repairs are frequent; with routes on (the default)
it syncs before the layers that miss instead."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

import runtime.decode.segment_repair as segment_repair
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle as _idle, watch_repairs

N = 24


def _decode(om, segment, n=N, **options):
    return decode_through_pass(om, n, segment=segment, **options)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("segment", [1, 2])
def test_segment_repairs_are_lossless_and_recompute_one_segment(family, segment, tiny_dirs):
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(load(str(tiny_dirs[family]))[0], ids, N)
        tokens, dp = _decode(om, segment)
        assert tokens == expected
        st = dp.stats
        assert st.repairs > 0 and st.boundary_syncs > 0  # the budget makes misses: segments were exercised
        # Every host sync of the passes is counted: one per forward, one per repair, one per boundary.
        assert st.host_syncs == st.passes + st.repairs + st.boundary_syncs
        # A repair at a boundary recomputes at most its segment.
        assert st.boundary_repairs > 0 and st.boundary_recomputed <= st.boundary_repairs * segment
        assert _idle(om)
    finally:
        om.close()


def test_auto_segments_only_while_repairs_are_frequent(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        tokens, dp = _decode(om, "auto")
        assert dp.stats.repairs == 0 and dp.stats.boundary_syncs == 0 and dp.segment_size() is None
        assert dp.stats.host_syncs == dp.stats.passes  # one sync per token, as "on"
    finally:
        om.close()
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        # q = 1 (a sync costs a layer, as on a Mac with small layers): S >= 2. Segments are cut only with routes off:
        # "auto" with routes syncs before the layers that miss instead (tests/test_layer_routes.py).
        tokens, dp = _decode(om, "auto", sync_cost=1.0, route=False)
        assert tokens == greedy_ids(load(str(tiny_dirs["qwen3_moe"]))[0], ids, N)
        assert dp.repair_rate > 0 and dp.segment_size() is not None and dp.stats.boundary_syncs > 0
        q, L, r = dp.sync_cost, len(om.model.layers), dp.repair_rate
        assert dp.segment_size() == max(1, round((2 * q * L / r) ** 0.5)) >= 2 and dp.stats.routed == 0
    finally:
        om.close()


def test_a_segment_repair_without_its_rollback_is_caught(tiny_dirs, monkeypatch):
    """The lossless test above can fail: skip the caches' rollback and the tokens differ (or the run breaks)."""
    monkeypatch.setattr(segment_repair, "roll_back", lambda *a, **k: None)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(load(str(tiny_dirs["qwen3_moe"]))[0], ids, N)
        try:
            tokens, dp = _decode(om, 1)
        except Exception:
            return
        assert dp.stats.boundary_syncs > 0 and dp.stats.repairs > 0
        assert tokens != expected
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_window_repairs_within_its_segments_to_the_stock_logits(family, tiny_dirs):
    """A verify-sized window (3 tokens) with every expert absent: each segment repairs inside the forward,
    reusing the window's mask, and the logits are stock mlx-lm's."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    path = tiny_dirs[family]
    stock = load(str(path))[0]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = stock(mx.array(ids)[None])[:, -3:]
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-3])[None], cache=cache))
        for m in om.modules.values():
            m.release()
        om.cache.empty()  # every expert absent: every segment misses
        dp = DevicePass(om, segment=1)
        out = dp.run(lambda: om.model(mx.array(ids[-3:])[None], cache=cache), cache, 3)
        assert dp.stats.boundary_repairs > 0
        assert dp.stats.host_syncs == dp.stats.passes + dp.stats.repairs + dp.stats.boundary_syncs
        np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-5, atol=1e-5)
        assert _idle(om)
    finally:
        om.close()


def test_auto_carries_the_repair_rate_to_the_next_generation(tiny_dirs):
    """A new generation starts with the segments the last one ended with (the rate lives on the model), not with
    a repair of the whole tail; passes that never take segments neither read nor write it."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        assert om.decode_repair_rate == 0.0
        _, first = _decode(om, "auto")
        assert om.decode_repair_rate == first.repair_rate > 0
        second = DevicePass(om, segment="auto")
        assert second.repair_rate == first.repair_rate and second.segment_size() is not None
        assert DevicePass(om, segment=None).repair_rate == 0.0  # "on" and verify windows start from their own
        _, on = _decode(om, None)
        assert om.decode_repair_rate == first.repair_rate  # untouched by a pass without segments
    finally:
        om.close()


def test_the_sync_cost_is_measured_unless_given(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        _, dp = _decode(om, "auto")
        # q = a measured host sync over a decoder layer's share of the timed forwards (build to sync)
        assert dp._forward_s is not None and dp._forward_s > 0
        L = dp._n_layers
        assert dp.sync_cost == pytest.approx(segment_repair.sync_seconds() / (dp._forward_s / L))
        assert 0 < segment_repair.sync_seconds() < 0.05  # a host sync: microseconds, not a layer's compute
        assert DevicePass(om, segment="auto", sync_cost=0.3).sync_cost == 0.3
        with pytest.raises(ValueError, match="sync_cost"):
            DevicePass(om, segment="auto", sync_cost=0.0)
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_auto_routes_the_layers_that_miss_before_their_experts(family, tiny_dirs, monkeypatch):
    """At 25% every layer of these tiny models misses often: "auto" forwards sync the layers' lookup codes before
    their experts run (runtime/decode/route_sync.py), read what is absent and run each layer once: lossless, no
    segments, no routed layer ever found missing, and the rates (layers that read) keep them routed."""
    repairs = watch_repairs(monkeypatch)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        tokens, dp = _decode(om, "auto")
        assert tokens == greedy_ids(load(str(tiny_dirs[family]))[0], ids, N)
        st, n_moe = dp.stats, len(om.modules)
        assert st.routed >= N // 2 and st.route_reads > 0 and st.boundary_syncs == 0
        assert st.routed <= st.route_syncs <= st.routed * n_moe + st.repairs * n_moe
        assert all(not (m & r) for m, r in repairs)
        assert _idle(om)
    finally:
        om.close()


def test_a_routed_layer_that_does_not_look_up_again_is_caught(tiny_dirs, monkeypatch):
    """The test above can fail: a route() that reads but lets the layer run on its old codes leaves the
    forward to find the miss in a routed layer at its sync. Without next forwards, routed forwards sync as they
    are built (route()); with them they are staged (tests/test_paced_build.py)."""
    from runtime.decode.route_sync import RouteSync

    real = RouteSync.route
    monkeypatch.setattr(RouteSync, "route", lambda self, layer, indices, codes, ahead=None: real(self, layer, indices, codes, ahead)
                        and False)
    repairs = watch_repairs(monkeypatch)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        _decode(om, "auto", build_next=False)
        assert any(m & r for m, r in repairs)
    finally:
        om.close()

