"""Routed verify windows (runtime/decode/window_routes.py's rule on the windows' own miss rates, set up by
runtime/decode/speculative.py): a window's layers that keep missing sync their codes before their experts run,
so a miss there costs its read and no recompute; a window the forecast covered keeps its one host sync; only
unrouted layers wait for their prefetches before the window; greedy output stays the target's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.pass_stats import PassStats
from runtime.decode.speculative import SpecConfig
from runtime.decode.speculative_run import run_speculative
from runtime.decode.window_routes import LAYER_DECAY, WindowRoutes
from storage import ExpertKey
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import watch_repairs

N = 24


def _run(om, ids, dmodel, **kw):
    """The target itself as the drafter (every draft accepted: full windows every round, fixed K), no forecast."""
    return run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                           draft_model=dmodel, draft_config=om.config, **{"adaptive_k": False, **kw})


def _routes(om) -> WindowRoutes:
    order = sorted(om.moe_layers, key=om.decoder_index.get)
    return WindowRoutes(om.cache, order, om.decoder_index, SimpleNamespace(verify_layer_miss=None), PassStats())


def test_a_window_layer_routes_by_its_own_window_rate(tiny_dirs):
    """Layer l routes while w_l (R_l + E + q) > q, q = 0.05 and E = 2: on three decoder layers a repair from the
    first, middle, last recomputes R = 3, 2, 1, so the thresholds are 0.0099, 0.0123, 0.0164."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        r = _routes(om)
        first, middle, last = r.order
        rates = {(0.0, 0.0, 0.0): set(), (0.009, 0.009, 0.009): set(), (0.011, 0.011, 0.011): {first},
                 (0.0, 0.0, 0.02): {last}, (0.013, 0.013, 0.013): {first, middle}}
        for w, routed in rates.items():
            r.miss[:] = w
            assert r.layers() == routed, w
        dp = DevicePass(om)
        dp.routes.miss[:] = 1.0
        assert dp.window_routes() == frozenset()  # the owner has not allowed it
        dp.route_windows = True
        assert dp.window_routes() == frozenset(dp.order)
    finally:
        om.close()


def test_window_rates_start_above_the_threshold_where_a_layer_cannot_hold_every_expert(tiny_dirs):
    """A fresh cache holds the prompt's experts: the first windows miss. Below a full budget every layer starts
    routed, and windows that read nothing decay it below the threshold (one sync); at 100% nothing routes."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        r = _routes(om)
        assert r.layers() == frozenset(r.order)
        covered = 0
        while r.layers():
            r.note({})  # a window that read nothing
            covered += 1
        assert 30 <= covered <= 40  # ln 2 / -ln LAYER_DECAY ~ 34 windows
        first = r.order[0]
        before = r.miss.copy()
        r.note({first: [(np.array([1]), 0, 0.0)]})  # one read in the first layer routes it again
        assert r.layers() == {first}
        np.testing.assert_allclose(r.miss, LAYER_DECAY * before + (1 - LAYER_DECAY) * np.eye(3)[0])
        assert r.owner.verify_layer_miss is r.miss  # carried to the next generation
    finally:
        om.close()
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        assert not _routes(om).miss.any()
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
        assert (DevicePass(om).routes.miss == carried).all()  # the next generation starts from them
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
