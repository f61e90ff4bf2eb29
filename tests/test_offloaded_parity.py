"""Greedy tokens of the offloaded model equal stock mlx-lm's: prefill splits, stock unaffected, policies, I/O modes.

Every family at every budget, raw and packed: tests/test_family_contract.py.
"""

from __future__ import annotations

import pytest
from mlx_lm import load

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, greedy_ids


@pytest.fixture(scope="module")
def references(tiny_dirs):
    refs = {}
    for fam in ("qwen3_moe", "mixtral"):
        model, tok = load(str(tiny_dirs[fam]))
        ids = tok.encode(PROMPT)
        refs[fam] = (ids, greedy_ids(model, ids))
    return refs


def _budget(store_dir, budget: str) -> str:
    if budget != "min":
        return budget
    probe = OffloadedModel.load(store_dir, OffloadConfig(budget="100%"))
    minimum = probe.plan.min_bytes
    probe.close()
    return f"{minimum}B"


# The per-family greedy parity at every budget, raw and packed, is part of the family contract:
# tests/test_family_contract.py::test_greedy_tokens_identical_to_stock.


def test_min_budget_prefill_is_split_into_groups_that_fit(tiny_dirs, references):
    """At the minimum budget a prompt routes to more experts than there are slots."""
    path = tiny_dirs["qwen3_moe"]
    ids, expected = references["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget=_budget(path, "min")))
    try:
        assert greedy_ids(om.model, ids) == expected
        assert om.counters()["evictions"] > 0
    finally:
        om.close()


def test_stock_model_unaffected_in_same_process(tiny_dirs, references):
    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="25%"))
    try:
        ids, expected = references["qwen3_moe"]
        stock, _ = load(str(path))
        assert greedy_ids(stock, ids) == expected
        assert type(stock.model.layers[0].mlp.switch_mlp).__name__ == "SwitchGLU"
        assert type(om.model.model.layers[0].mlp.switch_mlp).__name__ == "CachedSwitchGLU"
    finally:
        om.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_and_io_modes_keep_output(policy, tiny_dirs, references):
    path = tiny_dirs["mixtral"]
    ids, expected = references["mixtral"]
    for io_mode in ["buffered", "direct"]:
        om = OffloadedModel.load(path, OffloadConfig(budget="25%", policy=policy, io_mode=io_mode, threads=2))
        try:
            assert greedy_ids(om.model, ids) == expected
        finally:
            om.close()
