"""Staged routed forwards and paced next-forward builds (runtime/decode/route_sync.py, paced_build.py): while
misses make plain decoding route every layer, a one-token forward is built whole, finish() syncs each MoE
layer's codes in order and reads what is absent before that layer's experts run, and the next token's forward
is built a layer at a time between those syncs. Lossless, no repair in a routed forward, every sync counted,
nothing left pinned, held or in device mode."""

from __future__ import annotations

import pytest
from mlx_lm import load

from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.paced_build import PacedBuild
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle, route_syncs_read_nothing

N = 24


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_staged_forwards_with_paced_next_builds_are_lossless(family, tiny_dirs):
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        tokens, dp = decode_through_pass(om, N, segment="auto")
        assert tokens == greedy_ids(load(str(tiny_dirs[family]))[0], om.tokenizer.encode(PROMPT), N)
        st, n_moe = dp.stats, len(om.modules)
        assert st.routed >= N // 2 and st.route_reads > 0 and st.route_syncs == st.routed * n_moe
        assert st.repairs <= (st.passes - st.routed) * n_moe  # none in a routed forward
        # Next forwards were built while routed ones synced, a layer per route sync; one is dropped only when the
        # forward it was built on repaired (a one-sync forward before the rate made them routed).
        assert st.next_built >= N // 3 and st.next_dropped <= st.repairs
        assert st.paced_layers >= (st.next_built - 1) * n_moe
        assert pass_idle(om) and om.cache.active_pass is None and dp._pacer is None
    finally:
        om.close()


def test_a_stage_that_does_not_read_is_caught(tiny_dirs, monkeypatch):
    """The test above can fail: route syncs that see the absent experts but read none leave the forward to find
    them at its own sync (repairs in routed forwards)."""
    route_syncs_read_nothing(monkeypatch)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        tokens, dp = decode_through_pass(om, N, segment="auto")
        st = dp.stats
        assert st.routed > 0 and st.repairs > (st.passes - st.routed) * len(om.modules)
    finally:
        om.close()


def test_without_next_forwards_routed_forwards_sync_as_they_build(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        tokens, dp = decode_through_pass(om, N, segment="auto", build_next=False)
        assert tokens == greedy_ids(load(str(tiny_dirs["qwen3_moe"]))[0], om.tokenizer.encode(PROMPT), N)
        st = dp.stats
        assert st.routed > 0 and st.next_built == 0 and st.paced_layers == 0
        assert st.route_syncs == st.routed * len(om.modules)
    finally:
        om.close()


class _Replay:
    def __init__(self):
        self.state = ("outer",)

    def park(self):
        return self.state

    def resume(self, state):
        self.state = state

    def start(self):
        self.state = ("fresh",)


class _Cache:
    active_pass = "outer pass"


def test_a_paced_build_runs_only_inside_step_with_its_own_state():
    replay, cache, seen = _Replay(), _Cache(), []
    holder = {}

    def build():
        for i in range(3):
            seen.append((i, replay.state, cache.active_pass))
            cache.active_pass, replay.state = "build pass", ("build", i)
            holder["pacer"].pause()
        return "built"

    pacer = holder["pacer"] = PacedBuild(build, replay, cache)
    assert seen == []  # nothing runs at creation
    pacer.step()
    assert seen == [(0, ("fresh",), None)]
    assert (replay.state, cache.active_pass) == (("outer",), "outer pass")  # the caller's state is back
    pacer.step()
    assert seen[-1] == (1, ("build", 0), "build pass")  # the build's own state, as it left it
    assert pacer.complete() == ("built", ("build", 2)) and pacer.done
    assert (replay.state, cache.active_pass) == (("outer",), "outer pass")


def test_a_paced_build_error_is_raised_by_complete():
    def build():
        raise ValueError("broken layer")

    pacer = PacedBuild(build, _Replay(), _Cache())
    with pytest.raises(ValueError, match="broken layer"):
        pacer.complete()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_routed_and_one_sync_forwards_in_turn_are_built_early_and_lossless(family, tiny_dirs, monkeypatch):
    """Every transition: a one-sync forward built a layer at a time between a staged forward's route syncs (held
    and queued when it becomes pending), and a staged forward built while a one-sync forward computes (queued
    when it becomes pending). Forwards alternate between routed and one-sync (no segments) here."""
    real = DevicePass._route_set

    def alternate(self, n_tokens, segments):  # the forward numbered stats.passes routes every layer when it is odd
        if n_tokens > 1:
            return real(self, n_tokens, segments)
        return self.lookup_layers if self.stats.passes % 2 == 1 else frozenset()

    monkeypatch.setattr(DevicePass, "_route_set", alternate)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
    try:
        tokens, dp = decode_through_pass(om, N, segment="auto")
        assert tokens == greedy_ids(load(str(tiny_dirs[family]))[0], om.tokenizer.encode(PROMPT), N)
        st, n_moe = dp.stats, len(om.modules)
        assert N // 3 <= st.routed <= st.passes - N // 3  # both kinds ran
        assert st.route_syncs == st.routed * n_moe and st.paced_layers > 0
        assert st.next_built >= N - 2 and st.next_dropped <= st.repairs
        assert pass_idle(om) and om.cache.active_pass is None and dp._pacer is None
    finally:
        om.close()
