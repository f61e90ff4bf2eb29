"""Routed verify windows (runtime/decode/speculative.py, runtime/decode/route_sync.py): while most windows
miss an expert, each MoE layer syncs its codes before its experts run, so a miss costs its read and no
recompute; a window the forecast covered keeps its one host sync; greedy output stays the target's."""

from __future__ import annotations

import pytest
from mlx_lm import load

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative import ROUTE_WINDOWS_RATE, SpecConfig
from runtime.decode.speculative_run import run_speculative
from tests.conftest import PROMPT, TINY, greedy_ids

N = 24


@pytest.fixture(scope="module")
def related(tiny_dirs):
    """The target itself as the drafter (every draft accepted: full windows every round)."""
    path = tiny_dirs["qwen3_moe"]
    return load(str(path))[0]


def _run(om, ids, dmodel, **kw):
    return run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                           draft_model=dmodel, draft_config=om.config, **kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_windows_that_keep_missing_are_routed_and_stay_lossless(family, tiny_dirs):
    """No forecast at 50%: windows miss, the repair rate climbs past the threshold, later windows are routed
    (they sync per layer and repair nothing); with route off every window syncs once plus its repairs."""
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

        om.empty_cache()
        tokens, routed, _ = _run(om, ids, dmodel)
        assert tokens == expected
        assert routed.n_rounds == off.n_rounds  # the same drafts, accepted alike
        assert 0 < routed.routed_rounds < routed.n_rounds  # the first windows repair; then they are routed
        assert routed.repairs < off.repairs  # a routed window reads at its layers' syncs and repairs nothing
        assert routed.host_syncs > routed.n_rounds + routed.repairs  # routed windows sync per MoE layer
    finally:
        om.close()


def test_covered_windows_keep_one_host_sync(tiny_dirs):
    """At 100% (warm start) no window misses: the rate stays 0, no window is routed, one sync per round."""
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


def test_one_sync_on_never_routes_and_a_bad_route_is_refused(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        _, stats, _ = _run(om, ids, load(str(path))[0], one_sync="on")
        assert stats.routed_rounds == 0 and stats.host_syncs == stats.n_rounds + stats.repairs
    finally:
        om.close()
    assert 0 < ROUTE_WINDOWS_RATE <= 1
    with pytest.raises(ValueError, match="route"):
        SpecConfig(route="sometimes")
