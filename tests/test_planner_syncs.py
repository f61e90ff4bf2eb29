"""The plan's host syncs follow the budget as the default decoding (`one_sync="auto"`) does: 1 per token at a full
budget, one per MoE layer + 1 below it; verify windows stay device passes that route the layers whose misses make a sync pay."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.cli import plan as plan_cli
from runtime.decode import ROUTE_REPAIR_EXTRA as REPAIR_EXTRA, ROUTE_SYNC_COST as SYNC_COST
from runtime.plan import CostConstants, HitRates, forward_time, load_model_config, mac_profile, model_costs
from runtime.plan.engine_costs import MLX_DEFAULT_FENCE_US, engine_overhead, specmoe_engine, window_routes

MODEL = "qwen3-30b-a3b"  # 48 MoE layers, ~16 GB of experts: all fit a 48 GB Mac, half a 16 GB one


def plain_syncs(budget: str, mac: str = "m3max-48gb") -> tuple[float, int]:
    plan = plan_cli.build_plan(model_ref=MODEL, mac_name=mac, budget_text=budget)
    return plan["projections"][0]["step"]["host_syncs"], plan["model"]["n_moe_layers"]


def test_plan_syncs_per_token_follow_the_budget():
    full, layers = plain_syncs("auto")
    partial, _ = plain_syncs("50%")
    small_mac, _ = plain_syncs("auto", mac="m4-16gb")
    assert layers == 48
    assert full == pytest.approx(1.0)
    assert partial == pytest.approx(layers + 1) and small_mac == pytest.approx(layers + 1)


def test_the_old_constant_fails_the_budget_rule(monkeypatch):
    # Mutation: the engine priced as one sync per forward at every budget (the cost model before).
    real = plan_cli.specmoe_engine
    monkeypatch.setattr(plan_cli, "specmoe_engine", lambda **kw: replace(
        real(**kw), partial_syncs_per_layer=None, routed_windows=False))
    partial, layers = plain_syncs("50%")
    assert partial != pytest.approx(layers + 1)  # the assertion above would fail: ~1 sync + repairs
    assert partial < 3


def test_partial_decode_priced_per_layer_at_the_sync_price():
    display, config, _ = load_model_config(MODEL)
    model, mac = model_costs(config, name=display), mac_profile("m4-16gb")
    constants = CostConstants(engine=specmoe_engine())
    full = forward_time(model, mac, HitRates(1.0, 0.0, "t", full_budget=True), constants)
    partial = forward_time(model, mac, HitRates(1.0, 0.0, "t", full_budget=False), constants)
    # Same bytes and compute: the difference is exactly the per-layer syncs, and a per-layer forward repairs nothing.
    assert partial.sync_ms - full.sync_ms == pytest.approx(model.n_moe_layers * MLX_DEFAULT_FENCE_US / 1000)
    missing = forward_time(model, mac, HitRates(0.8, 0.0, "t", full_budget=False), constants)
    assert missing.repairs == 0.0 and missing.host_syncs == pytest.approx(model.n_moe_layers + 1)


def test_verify_windows_route_the_layers_the_engine_would():
    assert window_routes(10, 20, 0.0) == 0 and window_routes(10, 20, 1.0) == 10
    # A layer near the end has less to recompute, so it routes only at a higher miss chance.
    last_threshold = SYNC_COST / (2 + REPAIR_EXTRA + SYNC_COST)  # the last MoE layer's tail: 20 - 9 * 2 layers
    assert window_routes(10, 20, last_threshold * 1.01) == 10
    assert window_routes(10, 20, last_threshold * 0.99) == 9
    engine = specmoe_engine(layer_us=0.0)
    partial = engine_overhead(engine, 10, 8.0, miss_share=0.2, expert_reads=300, full_budget=False, window=True)
    assert partial.routed_layers == 10 and partial.host_syncs == 11 and partial.repairs == pytest.approx(0.0)
    resident = engine_overhead(engine, 10, 8.0, miss_share=0.0, expert_reads=300, full_budget=False, window=True)
    assert resident.routed_layers == 0 and resident.host_syncs == 1
    full = engine_overhead(engine, 10, 8.0, miss_share=0.0, expert_reads=300, full_budget=True, window=True)
    assert full.host_syncs == 1 and full.repairs == 0.0


def test_measured_syncs_override_the_budget_rule():
    plan = plan_cli.build_plan(model_ref=MODEL, mac_name="m4-16gb", syncs_per_token=3.0, repairs_per_token=0.5)
    steps = [p["step"] for p in plan["projections"]]
    assert all(s["host_syncs"] == pytest.approx(3.0) and s["routed_layers"] == 0 for s in steps)
    assert plan["engine"]["partial_syncs_per_layer"] is None and not plan["engine"]["routed_windows"]


def test_one_sync_modes_price_their_paths():
    syncs = {mode: plan_cli.build_plan(model_ref=MODEL, mac_name="m4-16gb", one_sync=mode)["projections"]
             for mode in ("auto", "on", "off")}
    plain = {mode: p[0]["step"] for mode, p in syncs.items()}
    verify = {mode: p[2]["step"] for mode, p in syncs.items()}
    assert plain["auto"]["host_syncs"] == plain["off"]["host_syncs"] == pytest.approx(49)
    assert 1 < plain["on"]["host_syncs"] <= 2 and plain["on"]["repairs"] > 0.5  # device passes repair their misses
    assert verify["auto"]["routed_layers"] == 48 and verify["on"]["routed_layers"] == 0
    with pytest.raises(ValueError, match="expected auto, on or off"):
        specmoe_engine(one_sync="sometimes")
