"""Interleavings of a memory-governor shrink with pipelined forwards that once produced wrong tokens, unflagged.

A layer whose every expert sits in the slot numbered like it (a 100% budget, or a per-layer split that leaves one
layer whole) takes its router's ids as slots (runtime/cache/cached_switch.py, ids_are_slots): the slot numbers are
baked into the graph when the forward is built, and nothing flags them later. So the layer must be held (nothing
trimmed, evicted or zeroed) from that build to the forward's sync.

- Built early: while forward A is pending, forward B is built on A's lazy output (next_forward.py). A shrink lands
  before or after B's build; A's sync releases its hold, and a deferred trim would zero the slots B baked unless B
  holds them from its build. (When B was queued only once it became pending, as while repairs were frequent, the
  trim did zero them: other tokens, no repair.) The device is modelled as slow (mx.async_eval queues nothing; the
  graph runs at the next sync), a legal schedule.
- Between a staged forward's route syncs (when forwards were staged): each released the forward's holds around its
  layer's reads, and a pending shrink was trimmed then in its later, already built layers, those taking ids as
  slots included. Found by the differential harness (bench/stress_schedules.py, schedule 5).

The tests compare every token with stock mlx-lm (the last one the log-probabilities too).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

import runtime.decode.device_pass as device_pass
from runtime.decode import offloaded_generate_step
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.warm import warm_start
from tests.bench_scripts import load_bench_script
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import pass_idle

N = 16


@pytest.fixture(scope="module")
def stock(tiny_dirs):
    model, tok = load(str(tiny_dirs["qwen3_moe"]))
    return greedy_ids(model, tok.encode(PROMPT), N)


def _tokens(om, dp, on_token=None, usable=None) -> list[int]:
    warm_start(om)
    om.cache.settle_inflight()
    if usable is not None:
        om.cache.set_usable_slots(usable)
    gen = offloaded_generate_step(om, mx.array(om.tokenizer.encode(PROMPT)), max_tokens=N,
                                  sampler=lambda x: mx.argmax(x, axis=-1), device_pass=dp,
                                  after_prefill=om.cache.settle_inflight)
    out = []
    for token, _ in gen:
        out.append(token)
        if on_token is not None:
            on_token(len(out))
    return out


class _SlowDevice:
    """mlx.core as the decode modules see it, with mx.async_eval queueing nothing: a queued graph runs at the next
    mx.eval, as a device busy with earlier work would run it. Every other name is mlx.core's."""

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def async_eval(*_):
        return None


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_shrink_around_a_next_forwards_build_keeps_stock_tokens(tiny_dirs, stock, monkeypatch, when):
    """100% budget, every layer ids-are-slots, a slow device. The governor's shrink to top-k slots lands just before
    or just after the next forward's build, while the pending forward holds every layer."""
    monkeypatch.setattr(device_pass, "mx", _SlowDevice())
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    real, seen = DevicePass.launch_next, {"n": 0, "repairs": None}

    def launch_next(self, make_forward):
        seen["n"] += 1
        shrink = seen["n"] == 3
        if shrink and when == "before":
            om.cache.request_usable_slots(om.cache.min_usable)
            om.cache.usable_now()  # applied here, as the decode loop's next usable_now() applies it
        built = real(self, make_forward)
        if shrink and when == "after":
            om.cache.request_usable_slots(om.cache.min_usable)
            om.cache.usable_now()
        if shrink:
            seen["repairs"] = self.stats.repairs
        return built

    monkeypatch.setattr(DevicePass, "launch_next", launch_next)
    try:
        dp = DevicePass(om)
        got = _tokens(om, dp)
        assert om.cache.resize_stats.n_shrinks > 0 and dp.stats.next_built > 0
        assert got == stock, f"tokens {got} vs stock {stock}; repairs before the shrink {seen['repairs']}, " \
                             f"after {dp.stats.repairs}"
        assert pass_idle(om)
    finally:
        om.close()


@pytest.mark.parametrize("one_sync", ["auto", "on"])
def test_a_shrink_between_a_staged_forwards_route_syncs_keeps_stock_tokens(tiny_dirs, one_sync):
    """A staged forward is built whole; each route sync releases the forward's holds around its layer's reads. A
    shrink applied just before (the next usable_now()) is trimmed at that release in every layer, the later ones
    included: a later layer that took its ids as slots would then read trimmed slots. A per-layer split (the last
    MoE layer whole), routes learnt, one shrink to 11 slots after the second token (bench/stress_schedules.py's
    schedule 5, found by the harness: other tokens and logits, no repair, before staged forwards looked up). "auto"
    is the engine's default (staged forwards where the engine builds them), "on" a device pass whatever the budget."""
    harness = load_bench_script("stress_schedules")
    schedule = harness.Schedule(5, "mixtral", "split", "plain", "greedy", one_sync, "async", "", 12, ((0, 15), (1, 14)),
                                ((1, "resize", (11, True)),))
    refs = harness.References(dict(tiny_dirs))
    out = harness.run_schedule(schedule, refs)
    assert not out.error and out.shrinks > 0
    assert out.tokens == out.expected and out.logit_mismatches == 0, \
        f"tokens {out.tokens} vs stock {out.expected}; {out.logit_mismatches} logits differ, {out.repairs} repairs"
