"""bench/bench_planner_self.py's prediction arithmetic on fixed synthetic measurements (no timing, no MLX runs)."""

from __future__ import annotations

import statistics

import pytest

from runtime.plan.mac_profiles import GIB, measured_profile
from runtime.plan.model_costs import model_costs
from runtime.plan.planner import CostConstants, HitRates, forward_time
from tests.bench_scripts import load_bench_script

CONFIG = {  # the bench's synthetic qwen3_moe: 8 layers x 64 experts, top-4, hidden 256
    "model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 256, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False,
}
CONTEXT = 40


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("bench_planner_self")


@pytest.fixture(scope="module")
def costs(bench):
    base = model_costs(CONFIG, bits=4, group_size=32)
    # 32-bit scales and biases: 0.5 + 8/32 = 0.75 bytes per weight, as the real store reports.
    return bench.with_store_bytes(base, expert_bytes=147_456, resident_bytes=1_471_488,
                                  resident_read_bytes_per_token=1_420_000, kv_bytes_per_token=8 * 2 * 2 * 64 * 4)


@pytest.fixture(scope="module")
def mac():
    return measured_profile("synthetic-cpu", ram_bytes=24 * GIB, mem_bandwidth_gbps=25.0, ssd_read_gbps=0.15,
                            page_cache_read_gbps=2.0, gpu_tflops=2.0e-3)


def rows(bench, *items):
    return [bench.MeasuredRow(label, mode, hit, (1 - hit) * 32, tps) for label, mode, hit, tps in items]


def test_store_bytes_replace_the_16_bit_scale_assumption(bench, costs):
    assert model_costs(CONFIG, bits=4, group_size=32).expert_bytes == 3 * 256 * 256 * 0.625
    assert costs.expert_bytes == 147_456 and costs.expert_total_bytes == 147_456 * 64 * 8
    assert costs.expert_params == 3 * 256 * 256  # FLOPs still come from the parameter count


def test_fit_row_is_reproduced_exactly_and_others_are_tests(bench, costs, mac):
    measured = rows(bench, ("100%", "buffered", 0.998, 40.0), ("25%", "buffered", 0.97, 38.0),
                    ("7%", "buffered", 0.82, 36.0))
    sync_ms, predicted = bench.predict_rows(costs, mac, measured, "100%", CONTEXT)
    assert [p.role for p in predicted] == ["fit", "test", "test"]
    assert predicted[0].tok_per_s == pytest.approx(40.0, rel=1e-12)
    assert predicted[0].error_pct == pytest.approx(0.0, abs=1e-9)
    # The constant is the planner's own: forward_time with it gives the measured 25 ms.
    step = forward_time(costs, mac, HitRates(0.998, 0.002, "t"), CostConstants(sync_ms_per_layer=sync_ms),
                        context_tokens=CONTEXT)
    assert step.total_ms == pytest.approx(25.0, rel=1e-12)
    # error = predicted / measured - 1, in percent
    for p in predicted[1:]:
        assert p.error_pct == pytest.approx(100 * (p.tok_per_s / p.measured.tok_per_s - 1))


def test_predicted_speed_falls_with_the_hit_rate_and_more_from_disk(bench, costs, mac):
    hits = [1.0, 0.97, 0.9, 0.8, 0.5]
    measured = rows(bench, *[(f"h{h}", "buffered", h, 40.0) for h in hits], ("disk", "direct", 0.8, 30.0))
    _, predicted = bench.predict_rows(costs, mac, measured, "h1.0", CONTEXT)
    speeds = [p.tok_per_s for p in predicted[:-1]]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > speeds[-1]
    hot_80, disk_80 = predicted[3], predicted[-1]
    assert disk_80.tok_per_s < hot_80.tok_per_s  # the disk is slower than the page cache
    # I/O is missed bytes over the tier's bandwidth: 0.2 x 32 experts x 147,456 B at 2.0 vs 0.15 GB/s.
    missed_bytes = 0.2 * 32 * 147_456
    assert hot_80.step.io_ms == pytest.approx(missed_bytes / 2.0e6)
    assert disk_80.step.ssd_ms == pytest.approx(missed_bytes / 0.15e6) and disk_80.step.page_cache_ms == 0


def test_constant_is_clamped_at_zero_and_bad_fit_rows_refused(bench, costs, mac):
    slow_run = rows(bench, ("100%", "buffered", 1.0, 1.0))  # 1 tok/s: far slower than the compute terms
    sync_ms, predicted = bench.predict_rows(costs, mac, slow_run, "100%", CONTEXT)
    assert sync_ms > 0
    impossible_run = rows(bench, ("100%", "buffered", 1.0, 10_000.0))  # faster than the FLOPs allow
    sync_ms, predicted = bench.predict_rows(costs, mac, impossible_run, "100%", CONTEXT)
    assert sync_ms == 0.0 and predicted[0].error_pct < 0
    with pytest.raises(ValueError, match="50%"):
        bench.predict_rows(costs, mac, impossible_run, "50%", CONTEXT)
    with pytest.raises(ValueError, match="io_mode"):
        bench.row_hits(bench.MeasuredRow("x", "mmap", 0.9, 1.0, 10.0))


def test_error_bound_rounds_the_worst_test_row_up_to_5_percent(bench, costs, mac):
    measured = rows(bench, ("a", "buffered", 1.0, 40.0), ("b", "buffered", 1.0, 36.0), ("c", "buffered", 1.0, 44.0))
    _, predicted = bench.predict_rows(costs, mac, measured, "a", CONTEXT)
    worst = max(abs(p.error_pct) for p in predicted[1:])  # 40/36 - 1 = 11.1%
    assert worst == pytest.approx(100 * (40 / 36 - 1))
    assert bench.error_bound_pct(predicted) == 15.0
    assert bench.error_bound_pct(predicted[:1]) is None
    assert bench.parse_rows("100%, 7% direct") == [("100%", "100%", "buffered"), ("7% direct", "7%", "direct")]


def test_paired_speeds_cancel_a_slowdown_shared_by_a_pass(bench):
    # Pass 2 runs on a CPU half as fast for everyone: the ratio to the reference does not change.
    passes = [{"ref": 40.0, "a": 20.0}, {"ref": 20.0, "a": 10.0}, {"ref": 40.0, "a": 20.0}]
    speeds = bench.paired_speeds(passes, "ref")
    assert speeds["ref"][0] == 40.0 and speeds["a"] == (20.0, 0.0)
    assert statistics.median(p["a"] for p in passes) == 20.0 and speeds["ref"][1] > 0


def test_miss_cost_compares_measured_and_modelled_ms_per_miss(bench, costs, mac):
    measured = rows(bench, ("100%", "buffered", 1.0, 40.0), ("7%", "buffered", 0.75, 1000 / 29.0))
    _, predicted = bench.predict_rows(costs, mac, measured, "100%", CONTEXT)
    cost = bench.miss_cost_ms(predicted)
    assert list(cost) == ["7%"]  # 8 extra misses per token; the fit row itself is left out
    assert cost["7%"][0] == pytest.approx((29.0 - 25.0) / 8)
    assert cost["7%"][1] == pytest.approx(147_456 / 2.0e6)  # one expert's bytes at the page-cache GB/s
