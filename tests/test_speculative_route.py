"""Routed verify windows (runtime/decode/route_sync.py's rule on the windows' own miss rates, set up by
runtime/decode/speculative.py): a window's layers that keep missing sync their codes before their experts run,
so a miss there costs its read and no recompute; a window the forecast covered keeps its one host sync; only
unrouted layers wait for their prefetches before the window; greedy output stays the target's."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.route_sync import LAYER_DECAY
from runtime.decode.speculative import SpecConfig
from runtime.decode.speculative_run import run_speculative
from storage import ExpertKey
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import watch_repairs

N = 24


def _run(om, ids, dmodel, **kw):
    """The target itself as the drafter (every draft accepted: full windows every round), no forecast."""
    return run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                           draft_model=dmodel, draft_config=om.config, **kw)


def _window_pass(om, sync_cost=0.1, repair_extra=0.0) -> DevicePass:
    dp = DevicePass(om, sync_cost=sync_cost)  # as the speculative decoder's: no segments
    dp.lookup_layers = frozenset(dp.order)
    dp.repair_extra = repair_extra
    return dp


def test_a_window_layer_routes_by_its_own_window_rate(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        dp = _window_pass(om)
        first, middle, last = dp.order  # decoder layers 0, 1, 2: a repair from there recomputes 3, 2, 1 layers
        assert dp.window_routes() == frozenset() and dp._route_set(4, True) == frozenset()  # the owner has not allowed it
        dp.route_windows = True
        rates = {(0.0, 0.0, 0.0): set(),
                 (0.02, 0.02, 0.02): set(),  # 0.02 x 3.1 < 0.1
                 (0.04, 0.04, 0.04): {first},  # 0.04 x 3.1 > 0.1 > 0.04 x 2.1
                 (0.0, 0.0, 0.2): {last},  # 0.2 x 1.1 > 0.1
                 (0.06, 0.06, 0.06): {first, middle}}
        for w, routed in rates.items():
            dp.window_miss[:] = w
            assert dp.window_routes() == routed, w
            assert dp._route_set(4, True) == routed  # a window of 4 tokens
            assert dp._route_set(1, True) == routed  # a plain round (K = 0) is a window of one token
        dp.window_miss[:] = 0.02
        dp.repair_extra = 2.0  # E: 0.02 x (3 + 2 + 0.1) > 0.1
        assert dp.window_routes() == {first}
        dp.lookup_layers = frozenset({middle, last})  # a layer that does not look up on the device never routes
        dp.window_miss[:] = 0.06
        dp.repair_extra = 0.0
        assert dp._route_set(4, True) == {middle}
        dp.layer_miss[:] = 1.0  # one-token forwards' rates are not the windows'
        dp.window_miss[:] = 0.0
        assert dp._route_set(4, True) == frozenset()
        off = DevicePass(om, route=False)
        off.lookup_layers, off.route_windows = frozenset(off.order), True
        off.window_miss[:] = 1.0
        assert off._route_set(4, True) == frozenset()  # routes off: never routed
    finally:
        om.close()


def test_window_rates_start_above_the_threshold_where_a_layer_cannot_hold_every_expert(tiny_dirs):
    """A fresh cache holds the prompt's experts: the first windows miss. Below a full budget every layer starts
    routed, and windows that read nothing decay it below the threshold (one sync); at 100% nothing routes."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        dp = _window_pass(om, repair_extra=2.0)
        dp.window_miss = dp._window_prior()
        dp.route_windows = True
        assert dp.window_routes() == frozenset(dp.order)
        covered = 0
        while dp.window_routes():
            dp._note_window_misses({})  # a window that read nothing
            covered += 1
        assert 30 <= covered <= 40  # ln 2 / -ln LAYER_DECAY ~ 34 windows
        first = dp.order[0]
        before = dp.window_miss.copy()
        dp._note_window_misses({first: [(np.array([1]), 0, 0.0)]})  # one read in the first layer routes it again
        assert dp.window_routes() == {first}
        np.testing.assert_allclose(dp.window_miss, LAYER_DECAY * before + (1 - LAYER_DECAY) * np.eye(3)[0])
    finally:
        om.close()
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        assert not DevicePass(om)._window_prior().any()
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_windows_that_keep_missing_are_routed_and_stay_lossless(family, tiny_dirs):
    """No forecast at 50%: windows miss in every layer. Routed from the first window (the prior), they sync per
    MoE layer and repair nothing; with route off every window syncs once plus its repairs. The windows' rates
    carry to the next generation."""
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        dmodel = load(str(path))[0]
        om.empty_cache()
        off_tokens, off, _ = _run(om, ids, dmodel, route="off")
        assert off_tokens == expected
        assert off.routed_rounds == 0
        assert off.host_syncs == off.n_rounds + off.repairs
        assert off.repairs >= off.n_rounds  # no forecast: every window misses somewhere
        assert om.verify_layer_miss is None  # windows that may not route keep no rates

        om.empty_cache()
        tokens, routed, _ = _run(om, ids, dmodel)
        assert tokens == expected
        assert routed.n_rounds == off.n_rounds  # the same drafts, accepted alike
        assert routed.routed_rounds == routed.n_rounds
        assert routed.repairs < off.repairs  # a routed layer reads at its route sync and repairs nothing
        assert routed.host_syncs > routed.n_rounds + routed.repairs  # routed windows sync per MoE layer
        carried = np.array(om.verify_layer_miss)
        assert carried.shape == (len(om.moe_layers),) and (carried > 0).all()
        assert (DevicePass(om).window_miss == carried).all()  # the next generation starts from them
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_partly_routed_windows_are_lossless_and_repair_only_unrouted_layers(family, tiny_dirs, monkeypatch):
    """Windows routed in their first MoE layer only: the others look up without a sync and are repaired at the
    window's sync; greedy output equals the target's and a routed layer is never the one found missing."""
    real = DevicePass.window_routes
    monkeypatch.setattr(DevicePass, "window_routes", lambda self: real(self) & {self.order[0]})
    repairs = watch_repairs(monkeypatch)
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        om.empty_cache()
        tokens, stats, _ = _run(om, ids, load(str(path))[0])
        assert tokens == expected
        assert stats.routed_rounds == stats.n_rounds and stats.repairs > 0
        assert repairs and all(not (missing & routed) for missing, routed in repairs)
        assert all(routed == {om.moe_layers[0]} for _, routed in repairs)
    finally:
        om.close()


def test_covered_windows_keep_one_host_sync(tiny_dirs):
    """At 100% (warm start) no window misses: the rates stay 0, no window is routed, one sync per round."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        tokens, stats, _ = _run(om, ids, load(str(path))[0])
        assert tokens == greedy_ids(om.model, ids, N)
        assert stats.routed_rounds == 0 and stats.repairs == 0
        assert stats.host_syncs == stats.n_rounds
    finally:
        om.close()


def test_only_the_given_layers_prefetches_are_settled(tiny_dirs):
    """settle_inflight(layers): an unrouted layer's prefetches land before the window; a routed layer's are left in
    flight (its route sync waits for them)."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%", inject="slow:layer=2,ms=600"))
    try:
        fast, slow = om.moe_layers[0], om.moe_layers[-1]
        assert om.decoder_index[slow] == 2
        om.cache.prefetch([ExpertKey(fast, 0), ExpertKey(slow, 0)], 1, None)
        om.cache.settle_inflight({fast})
        inflight = set(om.cache._tickets)
        assert ExpertKey(fast, 0) not in inflight and ExpertKey(slow, 0) in inflight
        om.cache.settle_inflight()
        assert not om.cache._tickets
    finally:
        om.close()


def test_one_sync_on_never_routes_and_a_bad_route_is_refused(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        _, stats, _ = _run(om, ids, load(str(path))[0], one_sync="on")
        assert stats.routed_rounds == 0 and stats.host_syncs == stats.n_rounds + stats.repairs
    finally:
        om.close()
    with pytest.raises(ValueError, match="route"):
        SpecConfig(route="sometimes")
