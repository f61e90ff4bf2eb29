"""Planner: model byte counts against published facts, Mac profiles, the cost model and `specmoe plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from runtime.cli import plan as plan_cli
from tests.bench_scripts import load_bench_script
from runtime.cache.budget import BudgetSpec
from runtime.plan.mac_profiles import GIB, MIB, known_chips, mac_profile, measured_profile
from runtime.plan.engine_costs import DEFAULT_LAYER_US
from runtime.plan.model_costs import affine_bytes_per_weight, model_costs
from runtime.plan.model_presets import load_model_config, preset, preset_names
from runtime.plan.planner import (
    DEFAULT_SYNC_MS_PER_LAYER,
    CostConstants,
    HitRates,
    SpecAssumptions,
    forward_time,
    hit_rates,
    plan_memory,
    project,
    required_hit_rate,
)

REPO = Path(__file__).resolve().parent.parent


def costs(name: str, **kwargs):
    display, config, _ = load_model_config(name)
    return model_costs(config, name=display, **kwargs)


# --- model costs -----------------------------------------------------------------------------


def test_affine_4bit_group64_is_0_5625_bytes_per_weight():
    assert affine_bytes_per_weight(4, 64) == 0.5625
    assert affine_bytes_per_weight(16) == 2.0


def test_published_memory_facts_qwen35_and_qwen3():
    # mac-and-models.md: 1.77 MB per Qwen3.5 expert [M1P], ~18.1 GB of experts; Qwen3-30B 2.65 MB, ~16.3 GB.
    qwen35 = costs("qwen3.5-35b-a3b")
    assert qwen35.expert_bytes == 1_769_472
    assert qwen35.expert_total_bytes / 1e9 == pytest.approx(18.1, abs=0.05)
    qwen3 = costs("qwen3-30b-a3b")
    assert qwen3.expert_bytes / 1e6 == pytest.approx(2.65, abs=0.01)
    assert qwen3.expert_total_bytes / 1e9 == pytest.approx(16.3, abs=0.05)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_reproduces_its_reference_row(name):
    record = preset(name)
    assert record["source"], f"{name} has no source"
    model = costs(name)
    reference = record["reference"]
    assert model.expert_bytes / 1e6 == pytest.approx(reference["expert_mb"], rel=0.01)
    if "experts_gb" in reference:
        assert model.expert_total_bytes / 1e9 == pytest.approx(reference["experts_gb"], rel=0.01)
    assert model.resident_bytes / 1e9 == pytest.approx(reference["non_expert_gb"], rel=0.03)


def test_nested_text_config_equals_flat_config():
    _, nested, _ = load_model_config("qwen3.5-35b-a3b")
    flat = dict(nested["text_config"], model_type="qwen3_5_moe")
    assert model_costs(nested) == model_costs(flat)


def test_kv_bytes_per_family():
    assert costs("qwen3-30b-a3b").kv_bytes_per_token == 48 * 2 * 4 * 128 * 2
    qwen35 = costs("qwen3.5-35b-a3b")  # only the 10 full-attention layers grow with context
    assert qwen35.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2
    assert qwen35.kv_bytes(0) == qwen35.state_bytes > 0
    gpt_oss = costs("gpt-oss-20b")  # sliding layers stop growing at 128 tokens
    assert gpt_oss.kv_bytes(1000) - gpt_oss.kv_bytes(500) == 500 * gpt_oss.kv_bytes_per_token


def test_top_k_override_and_bad_config():
    assert costs("qwen3.5-35b-a3b", top_k=4).experts_read_per_token == 160
    with pytest.raises(ValueError, match="top-k"):
        costs("qwen3.5-35b-a3b", top_k=300)
    with pytest.raises(ValueError, match="'llama'"):
        model_costs({"model_type": "llama"})
    with pytest.raises(ValueError, match="missing field 'num_attention_heads'"):
        model_costs({"model_type": "olmoe", "hidden_size": 64, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="--bits"):
        costs("olmoe", bits=7)


# --- Mac profiles ----------------------------------------------------------------------------


def test_m4_16gb_profile_uses_published_numbers():
    mac = mac_profile("m4-16gb")
    # 2/3 of 16 GiB = 10922.67 MiB [LCPP687]
    assert mac.gpu_working_set_bytes / MIB == pytest.approx(10922.67, abs=0.5)
    assert mac.mem_bandwidth_gbps == 120.0 and mac.ssd_read_gbps == 2.79
    assert mac_profile("m4-16gb", ssd_capacity_gb=512).ssd_read_gbps == 3.0
    assert mac_profile("m4-16gb", wired_limit_mb=14000).gpu_working_set_bytes == 14000 * MIB
    assert mac_profile("M4 Pro-24GB").name == "m4pro-24gb"


def test_every_chip_number_has_a_source():
    data = json.loads((REPO / "runtime" / "data" / "macs.json").read_text())
    assert sorted(data["chips"]) == known_chips() and len(known_chips()) == 12
    for chip in data["chips"].values():
        for key in ("mem_bandwidth_gbps", "gpu_cores", "gpu_tflops", "default_ssd_gb"):
            assert chip[key]["source"]
        assert chip["ssd_read_gbps"][-1]["max_capacity_gb"] is None
        assert all(entry["source"] for entry in chip["ssd_read_gbps"])


@pytest.mark.parametrize("name, fragment", [("m9-16gb", "unknown chip"), ("m4", "CHIP-RAMgb"),
                                            ("m4-4gb", "outside")])
def test_bad_mac_names(name, fragment):
    with pytest.raises(ValueError, match=fragment):
        mac_profile(name)


# --- cost model ------------------------------------------------------------------------------


def test_plan_memory_auto_fills_the_working_set():
    model, mac = costs("qwen3.5-35b-a3b"), mac_profile("m4-16gb")
    memory = plan_memory(model, mac, BudgetSpec("auto", 0.0, "auto"), 4096, drafter_bytes=300_000_000)
    assert memory.fits and memory.free_bytes == 0
    assert 0.3 < memory.cache_fraction < 0.6  # ~8 GB of ~18 GB, as the reference's takeaway says


def test_plan_memory_reports_what_to_change():
    model, mac = costs("qwen3.5-35b-a3b"), mac_profile("m4-16gb")
    too_big = plan_memory(model, mac, BudgetSpec("bytes", 20e9, "20GB"))
    assert not too_big.fits and "lower --budget" in too_big.advice[0]
    mixtral = plan_memory(costs("mixtral-8x7b"), mac_profile("m1-8gb"), BudgetSpec("auto", 0.0, "auto"))
    assert not mixtral.fits and "more RAM" in mixtral.advice[0]
    assert "wired_limit" not in mixtral.advice[0]  # 8 GB cannot give what it needs
    squeezed = plan_memory(costs("qwen3.5-35b-a3b"), mac, BudgetSpec("auto", 0.0, "auto"), headroom_bytes=9_500_000_000)
    assert not squeezed.fits and "iogpu.wired_limit_mb to at least" in squeezed.advice[0]
    share = plan_memory(model, mac, BudgetSpec("fraction", 0.4, "40%"))
    assert share.cache_fraction == pytest.approx(0.4, abs=1e-6)


def test_hit_rates_full_cache_and_page_cache_tier():
    model, mac = costs("olmoe-1b-7b"), mac_profile("m4-16gb")
    full = hit_rates(plan_memory(model, mac, BudgetSpec("auto", 0.0, "auto")))
    assert full.cache == 1.0 and full.ssd == 0.0
    qwen = costs("qwen3.5-35b-a3b")
    tiered = hit_rates(plan_memory(qwen, mac, BudgetSpec("bytes", 4e9, "4GB"), page_cache=True), 0.7)
    assert tiered.cache == 0.7 and 0 < tiered.page_cache < 0.3
    with pytest.raises(ValueError, match="hit-rate"):
        hit_rates(plan_memory(qwen, mac, BudgetSpec("bytes", 4e9, "4GB")), 1.2)


def test_forward_time_terms():
    model, mac, constants = costs("qwen3.5-35b-a3b"), mac_profile("m4-16gb"), CostConstants()
    resident = forward_time(model, mac, HitRates(1.0, 0.0, "t"), constants)
    assert resident.io_ms == 0.0
    assert resident.sync_ms == pytest.approx(40 * DEFAULT_SYNC_MS_PER_LAYER)
    # Reference anchor: 1.09 GB non-expert + 0.566 GB experts at 120 GB/s is a ~13.8 ms floor;
    # the model also reads the 64 MB linear-attention state, hence ~14.4 ms.
    assert resident.dense_ms + resident.expert_compute_ms == pytest.approx(13.8, rel=0.06)
    cold = forward_time(model, mac, HitRates(0.0, 0.0, "t"), constants)
    assert cold.ssd_ms == pytest.approx(model.expert_bytes_per_token / 2.79e6)
    prefetched = forward_time(model, mac, HitRates(0.0, 0.0, "t"), constants, prefetch_recall=0.5)
    assert 0 < prefetched.hidden_io_ms <= 0.5 * prefetched.io_ms
    verify = forward_time(model, mac, HitRates(1.0, 0.0, "t"), constants, n_tokens=4)
    assert verify.unique_experts_per_layer == pytest.approx(256 * (1 - (248 / 256) ** 4))


def test_speculation_decomposition():
    model, mac, constants = costs("qwen3-30b-a3b"), mac_profile("m4pro-48gb"), CostConstants()
    hits = HitRates(1.0, 0.0, "t")
    base = project(model, mac, hits, constants)
    good = project(model, mac, hits, constants, spec=SpecAssumptions(3, 0.75, 300_000_000))
    assert good.spec.tokens_per_round == pytest.approx(2.73, abs=0.01)
    assert good.spec.unique_experts_per_layer == pytest.approx(29.1, abs=0.05)
    # The verify ratio is the 4-token forward (loader overlapping the drafter) over the 1-token one:
    # more than one token's cost, less than four, because the window shares resident weights.
    verify4 = forward_time(model, mac, hits, constants, n_tokens=4, context_tokens=4096,
                           extra_overlap_ms=good.spec.draft_ms)
    assert good.spec.verify_ratio == pytest.approx(verify4.total_ms / base.step.total_ms, rel=1e-9)
    assert base.step.total_ms < verify4.total_ms < 4 * base.step.total_ms
    assert good.tok_per_s == pytest.approx(base.tok_per_s * good.spec.speedup, rel=1e-9)
    assert good.tok_per_s > base.tok_per_s  # per-layer syncs are amortised over accepted tokens
    hopeless = project(model, mac, hits, constants, spec=SpecAssumptions(3, 0.0, 300_000_000))
    assert hopeless.tok_per_s < base.tok_per_s


def test_required_hit_rate_solves_the_target():
    model, mac, constants = costs("qwen3.5-35b-a3b"), mac_profile("m4-16gb"), CostConstants()
    needed = required_hit_rate(10.0, model, mac, constants)
    assert 0 < needed < 1
    reached = project(model, mac, HitRates(needed, 0.0, "t"), constants)
    assert reached.tok_per_s == pytest.approx(10.0, rel=1e-3)
    assert required_hit_rate(500.0, model, mac, constants) is None
    assert required_hit_rate(0.1, model, mac, constants) == 0.0


def test_measured_profile_feeds_the_same_model():
    mac = measured_profile("this-box", ram_bytes=24 * GIB, mem_bandwidth_gbps=20.0, ssd_read_gbps=1.5,
                           page_cache_read_gbps=5.0, gpu_tflops=0.1)
    step = forward_time(costs("olmoe-1b-7b"), mac, HitRates(0.5, 0.0, "t"), CostConstants(sync_ms_per_layer=0.1))
    assert step.total_ms > 0 and mac.sources["ssd_read_gbps"] == "measured"


def test_bench_fit_matches_the_planner_default():
    bench = load_bench_script("validate_planner")
    assert bench.fit_sync_ms(bench.ROWS) == pytest.approx(DEFAULT_SYNC_MS_PER_LAYER, abs=0.002)
    assert bench.fit_layer_us(bench.ROWS) == pytest.approx(DEFAULT_LAYER_US, abs=1.0)


# --- CLI -------------------------------------------------------------------------------------


@pytest.fixture()
def run_plan():
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keeps `plan` a subcommand, as in the project's app
        pass

    plan_cli.register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["plan", *args], env={"COLUMNS": "160"})


def test_cli_prints_tables_and_writes_json(run_plan, tmp_path):
    out = tmp_path / "plan.json"
    result = run_plan("--model", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "fits" in result.stdout and "Projected decode speed" in result.stdout
    assert "PROJECTION" in result.stdout
    data = json.loads(out.read_text())
    assert [p["kind"] for p in data["projections"]] == ["projection"] * 4
    assert data["memory"]["fits"] and data["model"]["expert_mb"] == pytest.approx(1.769, abs=1e-3)


def test_cli_does_not_fit_is_an_answer_not_an_error(run_plan):
    result = run_plan("--model", "mixtral-8x7b", "--mac", "m1-8gb")
    assert result.exit_code == 0 and "does not fit" in result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--model", "qwen3.5-35b-a3b", "--mac", "m9-16gb"), "unknown chip"),
        (("--model", "no-such-model", "--mac", "m4-16gb"), "neither a preset"),
        (("--model", "missing/config.json", "--mac", "m4-16gb"), "no such file"),
        (("--model", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--budget", "lots"), "--budget"),
        (("--model", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--hit-rate", "2"), "--hit-rate"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(run_plan, args, fragment):
    result = run_plan(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_cli_malformed_config_and_unwritable_json(run_plan, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    result = run_plan("--model", str(bad), "--mac", "m4-16gb")
    assert result.exit_code == 2 and "not a readable JSON config" in result.stderr
    target = tmp_path / "nope" / "plan.json"
    result = run_plan("--model", "olmoe", "--mac", "m4-16gb", "--json", str(target))
    assert result.exit_code == 2 and "does not exist" in result.stderr and not target.exists()


def test_glm_air_weight_counts_reproduce_the_published_total():
    """The glm-4.5-air reference row is derived from its dimensions; the published 106B total checks them."""
    from runtime.plan.model_families import family_weights

    record = preset("glm-4.5-air")
    w = family_weights("glm4_moe", record["config"])
    total = w.embedding + w.lm_head + w.quantized + w.router + w.small + w.n_moe_layers * w.n_experts * w.expert
    assert total / 1e9 == pytest.approx(record["reference"]["total_params_b"], rel=0.01)
    assert (w.n_layers, w.n_moe_layers) == (46, 45)  # layer 0 is dense
