"""A layer whose every expert sits in the slot numbered like it (runtime/cache/resident_tables.py,
ids_are_slots): device passes use the router's ids as slots there, with no table gather and no clamp;
anywhere else the table decides, and the flag follows every change of the lookup codes."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from storage import ExpertKey
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle

N = 12


class _NoGather:
    """Stands in for a module's device table: any lookup through it fails the test."""

    def __getitem__(self, _):
        raise AssertionError("the device table was gathered from")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_whole_warm_layer_uses_its_ids_as_slots_and_decodes_as_stock(tiny_dirs, family):
    model, tok = load(str(tiny_dirs[family]))
    want = greedy_ids(model, tok.encode(PROMPT), N)
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="100%"))
    try:
        om.cache.warm([ExpertKey(l, e) for l in om.moe_layers for e in range(om.store.layout(l).n_experts)])
        om.cache.settle_inflight()
        assert all(om.cache.ids_are_slots(l) for l in om.moe_layers)
        for m in om.modules.values():  # instance attributes only: the fast path must never look the table up
            object.__setattr__(m, "_table", _NoGather())
        got, dp = decode_through_pass(om, N)
        assert got == want
        assert dp.stats.repairs == 0 and pass_idle(om)
    finally:
        om.close()


def test_experts_in_other_slots_are_looked_up_and_decode_as_stock(tiny_dirs):
    """Every expert valid but warmed in reverse order (expert e in slot E-1-e): not the fast path. Taking the
    ids as slots here would run the wrong experts, and the tokens would differ."""
    model, tok = load(str(tiny_dirs["qwen3_moe"]))
    want = greedy_ids(model, tok.encode(PROMPT), N)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        om.cache.warm([ExpertKey(l, e) for l in om.moe_layers for e in reversed(range(om.store.layout(l).n_experts))])
        om.cache.settle_inflight()
        assert not any(om.cache.ids_are_slots(l) for l in om.moe_layers)
        got, _ = decode_through_pass(om, N)
        assert got == want
    finally:
        om.close()


def test_the_flag_follows_evictions_and_commits(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        layer, other = om.moe_layers[0], om.moe_layers[1]
        n = om.store.layout(layer).n_experts
        om.cache.warm([ExpertKey(l, e) for l in (layer, other) for e in range(n - 1)])
        om.cache.settle_inflight()
        assert not om.cache.ids_are_slots(layer)  # one expert still absent
        om.cache.load_absent({layer: np.array([n - 1])})
        assert om.cache.ids_are_slots(layer) and not om.cache.ids_are_slots(other)  # a commit completed it
        om.cache.set_usable_slots({l: n - (l == layer) for l in om.moe_layers})  # a shrink evicts the expert in the last slot
        assert not om.cache.ids_are_slots(layer)
        om.cache.set_usable_slots(n)
        om.cache.load_absent({layer: np.array([n - 1])})  # back in its own slot, the only free one
        assert om.cache.ids_are_slots(layer)
        # Codes that equal the ids are the whole condition: expert e valid in slot e for every e.
        ls = om.cache.table.layers[layer]
        assert np.array_equal(ls.resident, np.arange(n)) and (ls.expert_to_slot == np.arange(n)).all()
    finally:
        om.close()


def test_a_partial_budget_never_takes_the_fast_path(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        decode_through_pass(om, 4)
        assert not any(om.cache.ids_are_slots(l) for l in om.moe_layers)
    finally:
        om.close()
