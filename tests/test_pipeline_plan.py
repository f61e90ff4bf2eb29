"""The pipeline planner (runtime/plan/pipeline_plan.py): N Macs over a link, projected."""

from __future__ import annotations

import pytest

from runtime.plan import load_model_config, mac_profile, model_costs
from runtime.plan.pipeline_plan import LINKS, link_profile, project_pipeline
from runtime.plan.planner import SpecAssumptions


def _model(name):
    display, config, _ = load_model_config(name)
    return model_costs(config, name=display), config


def test_one_mac_equals_the_single_mac_planner():
    costs, config = _model("qwen3.5-35b-a3b")
    p = project_pipeline(costs, config, mac_profile("m4-16gb"), 1, LINKS["tb5"], spec=SpecAssumptions())
    assert p.plain_tok_s == pytest.approx(p.single_tok_s, rel=1e-9)
    assert p.spec_tok_s == pytest.approx(p.single_spec_tok_s, rel=1e-9)  # incl. the hybrid's rollback re-run


def test_more_macs_split_the_model_and_raise_hit_rates():
    costs, config = _model("qwen3.5-397b-a17b")
    mac = mac_profile("m4-pro-64gb")
    plans = [project_pipeline(costs, config, mac, n, LINKS["tb5-rdma"]) for n in (1, 2, 4)]
    for p in plans:
        assert sum(r.expert_bytes for r in p.ranks) == costs.expert_total_bytes
        assert sum(r.n_moe_layers for r in p.ranks) == costs.n_moe_layers
    assert [max(r.resident_bytes for r in p.ranks) for p in plans] == sorted(
        (max(r.resident_bytes for r in p.ranks) for p in plans), reverse=True)
    assert plans[0].ranks[0].hit_rate < min(r.hit_rate for r in plans[1].ranks) < min(r.hit_rate for r in plans[2].ranks)
    assert plans[0].plain_tok_s < plans[1].plain_tok_s < plans[2].plain_tok_s


def test_a_slower_link_costs_one_hop_per_rank_per_token():
    costs, config = _model("qwen3.5-35b-a3b")
    mac = mac_profile("m4-16gb")
    fast = project_pipeline(costs, config, mac, 3, LINKS["tb5-rdma"])
    slow = project_pipeline(costs, config, mac, 3, LINKS["10gbe"])
    per_token_ms = 1000 / slow.plain_tok_s - 1000 / fast.plain_tok_s
    assert per_token_ms == pytest.approx(3 * (slow.hop_ms - fast.hop_ms), rel=1e-6)
    assert slow.hop_ms == pytest.approx(0.3 + costs.hidden_size * 2 / 1.1e6)


def test_bad_input_is_refused():
    costs, config = _model("qwen3.5-35b-a3b")
    with pytest.raises(ValueError, match="--ranks 41; expected 1..40"):
        project_pipeline(costs, config, mac_profile("m4-16gb"), 41, LINKS["tb4"])
    with pytest.raises(ValueError, match="--link 'usb'"):
        link_profile("usb")
