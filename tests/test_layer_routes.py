"""Per-layer routes (runtime/decode/route_sync.py): an "auto" one-token forward syncs before its experts only
in the layers whose own recent miss rate makes that pay, p_l (R_l + q) > q; the other layers look up without a
sync and a miss there is repaired at the forward's sync. Lossless with any mix, no routed layer ever found
missing, the rates carried across generations."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.route_sync import REPAIR_EXTRA
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle, route_syncs_read_nothing, watch_repairs

N = 24


def _rates(dp, p) -> None:
    dp.layer_miss[:] = p
    dp._missed = True  # as after a forward that read


def test_a_layer_routes_by_its_own_miss_rate_and_what_a_miss_there_recomputes(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        dp = DevicePass(om, segment="auto", sync_cost=0.1)
        first, middle, last = dp.order  # decoder layers 0, 1, 2: a miss there recomputes 3, 2, 1 layers
        dp.lookup_layers = frozenset(dp.order)
        dp.repair_extra = 0.0  # E: what a repair costs besides its layers
        rates = {(0.0, 0.0, 0.0): set(),
                 (0.02, 0.02, 0.02): set(),  # 0.02 x 3.1 < 0.1
                 (0.04, 0.04, 0.04): {first},  # 0.04 x 3.1 > 0.1 > 0.04 x 2.1
                 (0.0, 0.0, 0.2): {last},  # 0.2 x 1.1 > 0.1
                 (0.06, 0.06, 0.06): {first, middle}}
        assert dp._route_set(1, True) == frozenset()  # no layer ever read: nothing routes
        for p, routed in rates.items():
            _rates(dp, p)
            assert dp._route_set(1, True) == routed, p
        _rates(dp, 0.02)
        dp.repair_extra = 2.0  # a repair's head, reads and dropped next forward: 0.02 x (3 + 2 + 0.1) > 0.1
        assert dp._route_set(1, True) == {first}
        dp.lookup_layers = frozenset({middle, last})  # a layer that does not look up on the device never routes
        _rates(dp, 0.06)
        dp.repair_extra = 0.0
        assert dp._route_set(1, True) == {middle}
        assert dp._route_set(1, False) == frozenset()  # the prefill's first decode forward
        assert dp._route_set(4, True) == frozenset()  # windows: only while their owner allows it, by their own rates
        dp.route_windows = True  # (tests/test_speculative_route.py)
        dp.window_miss[:] = 1.0
        assert dp._route_set(4, True) == {middle, last}
        for other in (DevicePass(om, segment=None), DevicePass(om, segment="auto", route=False)):
            other.lookup_layers = frozenset(other.order)
            _rates(other, 1.0)
            assert other._route_set(1, True) == frozenset()  # "on", and routes off: never routed
    finally:
        om.close()


def _first_layer_only(monkeypatch):
    real = DevicePass._route_set

    def first_only(self, n_tokens, segments):
        routes = real(self, n_tokens, segments)
        return routes & {self.order[0]} if n_tokens == 1 else routes

    monkeypatch.setattr(DevicePass, "_route_set", first_only)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("build_next", [True, False])  # staged (synced by finish()), or synced as built
def test_partly_routed_forwards_are_lossless_and_repair_only_unrouted_layers(family, build_next, tiny_dirs,
                                                                          monkeypatch):
    _first_layer_only(monkeypatch)
    repairs = watch_repairs(monkeypatch)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        tokens, dp = decode_through_pass(om, N, segment="auto", build_next=build_next)
        assert tokens == greedy_ids(load(str(tiny_dirs[family]))[0], om.tokenizer.encode(PROMPT), N)
        st = dp.stats
        assert st.routed >= N // 2 and st.route_reads > 0
        # One route sync a routed forward, and one more for each repair that reran the routed layer (a sliding
        # window's, gpt_oss: it recomputes from the first layer)
        assert st.routed <= st.route_syncs <= st.routed + st.repairs
        assert st.boundary_syncs == 0  # routes replace segments
        routed_repairs = [(m, r) for m, r in repairs if r]
        assert routed_repairs  # the unrouted layers missed at 25%: partly routed forwards repaired
        assert all(not (m & r) for m, r in repairs)  # never a routed layer
        if build_next:
            assert st.paced_layers > 0 and st.next_built >= N // 2
        assert pass_idle(om) and om.cache.active_pass is None and dp._pacer is None
    finally:
        om.close()


def test_a_routed_layer_found_missing_is_caught(tiny_dirs, monkeypatch):
    """The test above can fail: route syncs that see the absent experts but read none leave the routed layer
    missing at the forward's sync."""
    route_syncs_read_nothing(monkeypatch)
    _first_layer_only(monkeypatch)
    repairs = watch_repairs(monkeypatch)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        decode_through_pass(om, N, segment="auto")
        assert any(m & r for m, r in repairs)
    finally:
        om.close()


def test_layer_miss_rates_carry_to_the_next_generation(tiny_dirs):
    """A new generation routes the layers the last one ended with (the rates live on the model); passes that
    never route per layer neither read nor write them."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        assert om.decode_layer_miss is None
        _, first = decode_through_pass(om, N, segment="auto")
        carried = first.layer_miss.copy()
        assert carried.max() > 0 and np.array_equal(om.decode_layer_miss, carried)
        # E was measured from the first forwards' repairs (before their layers routed), from a timed forward
        assert first.stats.repairs > 0 and om.decode_repair_extra == first.repair_extra != REPAIR_EXTRA
        second = DevicePass(om, segment="auto")
        assert np.array_equal(second.layer_miss, carried) and second.repair_extra == first.repair_extra
        assert not DevicePass(om, segment=None).layer_miss.any()  # "on" starts from none
        decode_through_pass(om, N, segment=None)
        assert np.array_equal(om.decode_layer_miss, carried)  # untouched by a pass that never routes per layer
    finally:
        om.close()


def test_json_reports_route_syncs_per_token_and_the_layers_that_route(tiny_dirs):
    """--json's GenerationStats: route syncs per decoded token and the MoE layers the rule routes at the end; at a
    full budget none (one sync per token)."""
    from runtime.decode.plain import generate_tokens

    for budget in ("25%", "100%"):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            tokens, stats = generate_tokens(om.model, om.tokenizer.encode(PROMPT), max_tokens=N, om=om)
            moe = set(om.modules)
            if budget == "100%":
                assert stats.route_syncs_per_token == 0 and stats.routed_layers == []
                assert stats.host_syncs_per_token == 1.0
            else:
                assert stats.routed_layers and set(stats.routed_layers) <= moe
                # every route sync is a host sync: at most the syncs per token beyond the token's own one
                assert 0 < stats.route_syncs_per_token <= stats.host_syncs_per_token - 1 + 1e-9
                assert stats.route_syncs_per_token <= len(moe)
            assert stats.to_json()["routed_layers"] == stats.routed_layers
        finally:
            om.close()


def test_a_layer_that_holds_every_expert_never_routes(tiny_dirs):
    """Only layers whose slots cannot hold every expert route: a full layer misses only while it fills (a cold
    stage's cache), and routing it on those misses would sync every token long after."""
    for budget, routes in (("100%", False), ("25%", True)):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget=budget))
        try:
            dp = DevicePass(om, segment="auto", sync_cost=0.1)
            dp.lookup_layers = frozenset(dp.order)
            _rates(dp, 0.5)  # every layer missed in half of the recent forwards
            assert dp._route_set(1, True) == (frozenset(dp.order) if routes else frozenset()), budget
            assert dp.routed_layers_now() == (list(dp.order) if routes else []), budget
            assert (dp._window_prior() > 0).all() == routes and (dp._window_prior() > 0).any() == routes, budget
        finally:
            om.close()
