"""Planner cost model v2: engine counts priced at MLX's sync costs, repairs, prefill, long context, CLI."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from runtime.cli import plan as plan_cli
from runtime.plan import CostConstants, HitRates, forward_time, load_model_config, mac_profile, model_costs
from runtime.plan.engine_costs import (
    COMMAND_BUFFER_US,
    MLX_DEFAULT_FENCE_US,
    MLX_FAST_SYNCH_US,
    EngineProfile,
    engine_overhead,
    expected_repairs,
    specmoe_engine,
)
from runtime.plan.prefill_cost import max_context_tokens, prefill_time


def costs(name: str):
    display, config, _ = load_model_config(name)
    return model_costs(config, name=display)


def test_overhead_counts_follow_the_engine():
    per_layer = EngineProfile("per-layer", syncs_per_forward=1, syncs_per_layer=2, command_buffers_per_layer=3,
                              repairs_per_token=0.0, layer_us=100.0)
    o = engine_overhead(per_layer, 40, compute_ms=10.0, miss_share=0.2, expert_reads=320)
    assert o.sync_ms == pytest.approx((1 + 2 * 40) * MLX_DEFAULT_FENCE_US / 1000)
    assert o.command_buffer_ms == pytest.approx(3 * 40 * COMMAND_BUFFER_US / 1000)
    assert o.layer_ms == pytest.approx(4.0) and o.repair_ms == 0.0


def test_repairs_expected_from_misses_and_priced_as_sync_plus_rerun():
    assert expected_repairs(0.0, 320) == 0.0
    assert expected_repairs(0.1, 2) == pytest.approx(1 - 0.81)
    engine = specmoe_engine(layer_us=0.0)
    o = engine_overhead(engine, 10, compute_ms=8.0, miss_share=0.1, expert_reads=2)
    buffers = 2 * 10 * COMMAND_BUFFER_US / 1000
    assert o.repairs == pytest.approx(0.19)
    assert o.repair_ms == pytest.approx(0.19 * (MLX_DEFAULT_FENCE_US / 1000 + 0.5 * (8.0 + buffers)))
    with pytest.raises(ValueError, match="miss share"):
        expected_repairs(1.5, 3)


def test_fast_synch_and_measured_values_replace_assumptions():
    slow, fast = specmoe_engine(), specmoe_engine(fast_synch=True)
    assert (slow.sync_us, fast.sync_us) == (MLX_DEFAULT_FENCE_US, MLX_FAST_SYNCH_US)
    measured = slow.with_measured(sync_us=55.0, syncs_per_token=1.5, repairs_per_token=0.5)
    assert measured.sync_us == 55.0 and measured.repairs_per_token == 0.5
    assert measured.syncs_per_forward == pytest.approx(1.0)  # measured syncs include the repairs' own
    assert not any(a.startswith(("sync price", "repairs")) for a in measured.assumed)
    assert any(a.startswith("sync price") for a in slow.assumed)


def test_v2_forward_is_the_sum_of_its_terms():
    model, mac = costs("qwen3-30b-a3b"), mac_profile("m4-16gb")
    engine = specmoe_engine(repairs_per_token=0.5)
    # A device pass (the engine's path at a full budget), here with measured repairs.
    step = forward_time(model, mac, HitRates(0.8, 0.0, "t", full_budget=True), CostConstants(engine=engine))
    layers = model.n_moe_layers
    fixed = (MLX_DEFAULT_FENCE_US + layers * (2 * COMMAND_BUFFER_US + engine.layer_us)) / 1000
    assert step.sync_ms == pytest.approx(fixed)
    rerun = 0.5 * (step.dense_ms + step.expert_compute_ms + fixed - MLX_DEFAULT_FENCE_US / 1000)
    assert step.repair_ms == pytest.approx(0.5 * (MLX_DEFAULT_FENCE_US / 1000 + rerun))
    assert step.host_syncs == pytest.approx(1.5)
    assert step.total_ms == pytest.approx(step.dense_ms + step.expert_compute_ms + step.io_ms + fixed + step.repair_ms)
    # Every expert cached: no repairs are expected, and v1 still prices its per-layer constant.
    resident = forward_time(model, mac, HitRates(1.0, 0.0, "t"), CostConstants(engine=specmoe_engine()))
    assert resident.repairs == 0.0 and resident.repair_ms == 0.0
    v1 = forward_time(model, mac, HitRates(1.0, 0.0, "t"), CostConstants(sync_ms_per_layer=1.0))
    assert v1.sync_ms == pytest.approx(layers) and v1.repair_ms == 0.0


def test_prefill_reads_each_expert_once_and_overlaps_compute():
    model, mac = costs("qwen3-30b-a3b"), mac_profile("m4-16gb")
    one = prefill_time(model, mac, 1, 0.0, first_token_ms=100.0)
    assert one.unique_experts_per_layer == pytest.approx(model.top_k)
    long = prefill_time(model, mac, 5000, 0.0, first_token_ms=100.0)
    assert long.unique_experts_per_layer == pytest.approx(model.n_experts, rel=1e-6)
    assert long.read_bytes == pytest.approx(model.expert_total_bytes, rel=1e-6)  # each expert once, not per token
    half = prefill_time(model, mac, 5000, 0.5, first_token_ms=100.0)
    assert half.read_bytes == pytest.approx(long.read_bytes / 2, rel=1e-6)
    assert long.ttft_ms == pytest.approx(max(long.io_ms, long.compute_ms) + long.fixed_ms + 100.0)
    with pytest.raises(ValueError, match="--prompt-tokens"):
        prefill_time(model, mac, 0, 0.0, first_token_ms=1.0)


def test_longest_context_is_where_kv_fills_the_room():
    model, mac = costs("qwen3-30b-a3b"), mac_profile("m4-16gb")
    headroom = 1_000_000_000
    context = max_context_tokens(model, mac, headroom_bytes=headroom)
    room = mac.gpu_working_set_bytes - model.resident_bytes - headroom - model.top_k * model.n_moe_layers * model.expert_bytes
    assert 0 < context and model.kv_bytes(context) <= room < model.kv_bytes(context + 1)
    assert max_context_tokens(model, mac, headroom_bytes=mac.gpu_working_set_bytes) == 0


@pytest.fixture()
def run_plan():
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    plan_cli.register(app)
    return lambda *args: CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "160"})


def test_cli_v2_names_its_assumptions_and_takes_doctor_measurements(run_plan, tmp_path):
    out = tmp_path / "plan.json"
    result = run_plan("--model", "qwen3-30b-a3b", "--mac", "m4-16gb", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["cost_model"] == "v2" and data["engine"]["sync_us"] == MLX_DEFAULT_FENCE_US
    assert any(a.startswith("sync price") for a in data["assumed"]) and "assumed:" in result.stdout
    assert data["prefill"]["kind"] == "projection" and data["max_context_tokens"] > 0
    doctor = tmp_path / "doctor.json"
    doctor.write_text(json.dumps({"kind": "specmoe-doctor", "planner_inputs": {
        "default_sync_us": 150.0, "fast_synch_sync_us": None, "repairs_per_token": 0.25,
        "acceptance_rate": 0.6, "forecast_recall": 0.7}}))
    result = run_plan("--model", "qwen3-30b-a3b", "--mac", "m4-16gb", "--from-doctor", str(doctor), "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["engine"]["sync_us"] == 150.0 and data["engine"]["repairs_per_token"] == 0.25
    assert data["speculation"]["acceptance_rate"] == 0.6 and data["prefetch_recall"] == 0.7
    assert not any(a.startswith(("sync price", "repairs per forward: one")) for a in data["assumed"])
    assert any("acceptance 0.6 measured by `specmoe doctor`" in a for a in data["assumed"])
    # A per-layer sync share measured on the embedded pair carries over to this model's depth.
    doctor.write_text(json.dumps({"kind": "specmoe-doctor", "planner_inputs": {
        "backend": "cpu", "default_sync_us": 100.0, "syncs_per_layer": 1.0, "repairs_per_token": 0.0}}))
    result = run_plan("--model", "qwen3-30b-a3b", "--mac", "m4-16gb", "--from-doctor", str(doctor), "--json", str(out))
    data = json.loads(out.read_text())
    step = data["projections"][0]["step"]
    assert data["engine"]["syncs_per_layer"] == 1.0 and step["host_syncs"] == pytest.approx(1 + 48)
    assert any("CPU backend" in a for a in data["assumed"])
    result = run_plan("--model", "qwen3-30b-a3b", "--mac", "m4-16gb", "--syncs-per-token", "3",
                      "--repairs-per-token", "0.5", "--json", str(out))
    step = json.loads(out.read_text())["projections"][0]["step"]
    assert step["host_syncs"] == pytest.approx(3.0) and step["repairs"] == pytest.approx(0.5)


@pytest.mark.parametrize("args, fragment", [
    (("--cost-model", "v3"), "--cost-model must be v1 or v2"),
    (("--from-doctor", "/no/such/doctor.json"), "--from-doctor"),
    (("--repairs-per-token", "-1"), "--repairs-per-token"),
    (("--syncs-per-token", "2"), "--syncs-per-token needs --repairs-per-token"),
])
def test_cli_v2_bad_input_is_one_line_exit_2(run_plan, args, fragment):
    result = run_plan("--model", "qwen3-30b-a3b", "--mac", "m4-16gb", *args)
    assert result.exit_code == 2 and fragment in result.output
