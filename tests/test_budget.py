"""Budget parsing, `auto`, the minimum, and slots per layer."""

from __future__ import annotations

import pytest

from runtime.cache.budget import parse_budget, plan_budget

LAYERS = {0: 1000, 1: 1000, 2: 1000}  # bytes per expert
EXPERTS = {0: 64, 1: 64, 2: 64}


def _plan(text, **kw):
    args = dict(expert_bytes=LAYERS, n_experts=EXPERTS, top_k=4, resident_bytes=10_000, kv_bytes=5_000)
    args.update(kw)
    return plan_budget(parse_budget(text), **args)


@pytest.mark.parametrize("text,expected", [("6GB", 6e9), ("512MiB", 512 * 2**20), ("1.5g", 1.5e9), ("300000", 300000)])
def test_sizes(text, expected):
    spec = parse_budget(text)
    assert spec.kind == "bytes" and spec.value == expected


@pytest.mark.parametrize("text", ["", "-3GB", "40", "0%", "150%", "lots", "5 parsecs"])
def test_bad_budgets_name_the_flag(text):
    if text == "40":  # a bare number is bytes, which is valid
        assert parse_budget(text).value == 40
        return
    with pytest.raises(ValueError, match="--budget"):
        parse_budget(text)


def test_fraction_of_expert_bytes():
    plan = _plan("50%")
    assert plan.slots == {0: 32, 1: 32, 2: 32}
    assert plan.budget_bytes == 96_000 and plan.fraction == 0.5


def test_budget_caps_at_all_experts():
    assert _plan("1GB").slots == {0: 64, 1: 64, 2: 64}


def test_below_minimum_says_the_minimum():
    with pytest.raises(ValueError, match="minimum is 12.00 KB"):
        _plan("11KB")
    assert _plan("12KB").slots == {0: 4, 1: 4, 2: 4}


def test_auto_uses_min_of_ram_and_working_set_minus_resident_kv_headroom():
    ram, ws = 16 * 10**9, int(10.67 * 10**9)
    plan = _plan("auto", total_memory_bytes=ram, working_set_bytes=ws, expert_bytes={0: 10**7}, n_experts={0: 10**4})
    b = plan.breakdown
    assert b["usable"] == ws
    assert b["left_for_experts"] == ws - 10_000 - 5_000 - b["headroom"]
    assert plan.slots[0] == b["left_for_experts"] // 10**7
    small = _plan("auto", total_memory_bytes=8 * 10**9, working_set_bytes=None, expert_bytes={0: 10**7}, n_experts={0: 10**4})
    assert small.breakdown["usable"] == 8 * 10**9


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "gpt-oss-20b", "glm-4.5-air", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_kv_estimate_for_auto_budgets_agrees_with_the_planner(name):
    """--budget auto's KV estimate and the planner's KV model are written independently; they agree
    per family (DeepSeek MLA caches decompressed keys and values, gpt-oss caps sliding layers)."""
    from runtime.cache import kv_bytes_estimate
    from runtime.plan.model_costs import model_costs
    from runtime.plan.model_presets import preset

    config = preset(name)["config"]
    for context in (100, 4096):
        assert kv_bytes_estimate(config, context) == model_costs(config).kv_bytes(context)
