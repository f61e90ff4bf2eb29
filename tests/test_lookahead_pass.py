"""The router lookahead folded into one-sync device passes (runtime/decode/lookahead_pass.py): no host sync
of its own (syncs/token stay 1 + repairs), lossless, forecasts scored, and a repair reads only forecasts
made from inputs that were right."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from predictor.lookahead import RouterLookahead
from runtime.decode import generate_tokens
from runtime.decode.device_pass import DevicePass
from runtime.decode.lookahead_pass import PassForecasts
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, greedy_ids

N = 16


def test_lookahead_in_device_passes_adds_no_sync_and_stays_lossless(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        hook = om.set_lookahead(1, 4, min_prob=0.0)  # prefetching: each source layer keeps a synced call
        tokens, st = generate_tokens(om.model, ids, max_tokens=N, om=om)
        assert tokens == expected and hook.stats.queued_bytes > 0
        assert st.host_syncs_per_token >= 1 + st.repairs_per_token + len(om.moe_layers) - 1 - 1e-9
        om.empty_cache()
        hook = om.set_lookahead(1, 4, min_prob=0.0, in_pass=True)
        tokens, st = generate_tokens(om.model, ids, max_tokens=N, om=om)  # one-sync device passes (default)
        assert tokens == expected
        assert st.one_sync_tries > 0 and st.repairs_per_token > 0  # 25%: the passes had to repair
        # Every host sync is a pass's own or a repair's: no layer kept a synced call for the forecast.
        assert st.host_syncs_per_token == pytest_approx(1 + st.repairs_per_token)
        assert hook.stats.forecasts > 0 and 0 < hook.stats.by_distance[1].recall <= 1
        assert om.cache.active_pass is None
    finally:
        om.close()


def test_a_repair_reads_forecast_experts_and_the_output_is_exact(tiny_dirs):
    """An empty cache: every layer misses. With the lookahead attached the repairs also read forecast experts of
    the layers after the first missing one; the output is the synced path's, bit for bit."""
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-1])[None], cache=cache))
        om.empty_cache()
        hook = om.set_lookahead(1, 4, min_prob=0.0, in_pass=True)
        offsets = [c.offset for c in cache]
        dp = DevicePass(om)  # default: forecasts are scored, not read by repairs
        dp.run(lambda: om.model(mx.array(ids[-1:])[None], cache=cache), cache, 1)
        assert dp.stats.repairs >= 1 and dp.ahead.repair_reads == 0
        for c, offset in zip(cache, offsets):
            c.trim(c.offset - offset)  # the same token again, from the same cache
        om.empty_cache()
        hook.in_repairs = True
        dp = DevicePass(om)
        out = dp.run(lambda: om.model(mx.array(ids[-1:])[None], cache=cache), cache, 1)
        assert dp.stats.repairs >= 1 and dp.stats.host_syncs == 1 + dp.stats.repairs
        assert dp.ahead.repair_reads > 0
        om.set_lookahead(0)
        ref = OffloadedModel.load(path, OffloadConfig(budget="50%"))
        try:
            rc = make_prompt_cache(ref.model)
            mx.eval(ref.model(mx.array(ids[:-1])[None], cache=rc))
            want = ref.model(mx.array(ids[-1:])[None], cache=rc)
            mx.eval(want)
        finally:
            ref.close()
        assert mx.array_equal(out, want).item()
    finally:
        om.close()


def pytest_approx(x):
    return pytest.approx(x, abs=1e-9)


@dataclass(frozen=True)
class _Hop:
    target: int
    distance: int


class _Hook:
    lookahead = RouterLookahead
    in_repairs = True


def test_repairs_use_only_forecasts_from_inputs_that_were_right():
    index = {10: 0, 11: 1, 12: 2, 13: 3}  # MoE layer -> decoder index
    pf = PassForecasts(index)
    hook = _Hook()
    pf._lazy = [
        (10, hook, [(_Hop(11, 1), np.array([[1, 2]])), (_Hop(12, 2), np.array([[3, -1]]))]),
        (11, hook, [(_Hop(12, 1), np.array([[4, 5]])), (_Hop(13, 2), np.array([[6, 7]]))]),
        (12, hook, [(_Hop(13, 1), np.array([[8, 9]]))]),  # after the first missing layer: its input was wrong
    ]
    pf.after_sync()
    needs = {11: np.array([1, 30]), 12: np.array([20])}  # layer 11 (index 1) missed first
    out = pf.extend(needs, first_missing=1, usable={10: 4, 11: 4, 12: 4, 13: 3})
    assert np.array_equal(out[11], [1, 30])  # not extended: its own routing was right and flagged exactly
    assert np.array_equal(out[12], [3, 4, 5, 20])  # forecasts from layers 10 and 11 (right inputs)
    assert np.array_equal(out[13], [6, 7])  # from 11, not 12's [8, 9]
    assert pf.repair_reads == 5
    capped = pf.extend({12: np.array([20, 21, 22])}, first_missing=1, usable={12: 4, 13: 1})
    assert np.array_equal(capped[12], [3, 20, 21, 22])  # 10's forecast fits; 11's would exceed the slots
    assert 13 not in capped  # two forecast experts never fit one slot
    pf.drop_from(1)  # the repair recomputes from decoder index 1: 11's and 12's forecasts are made again
    assert set(pf.take()) == {10} and pf.take() == {}
