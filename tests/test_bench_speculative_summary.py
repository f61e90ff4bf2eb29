"""bench/bench_speculative.py's summary: per-prompt medians group a variant's runs by prompt (passes outer, prompts
inner, the order main() runs them), so a pooled median that falls between prompts' clusters shows as such."""

import pytest

from tests.bench_scripts import load_bench_script


def _bench():
    return load_bench_script("bench_speculative")


def _run(tps: float, acceptance: float | None = None) -> dict:
    run = {"tokens_per_s": tps, "tokens": 48, "misses": 0.0, "mb": 0.0, "cpu_ms_per_token": 1.0}
    if acceptance is not None:
        run["acceptance"] = acceptance
    return run


def test_per_prompt_medians_group_runs_by_prompt():
    bench = _bench()
    # 4 passes x 2 prompts, in run order (pass outer): prompt 0 runs 1.0-1.3x its baseline, prompt 1 2.0-2.3x
    p0, p1 = [1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3]
    base = [_run(10.0), _run(20.0)] * 4
    runs = [r for a, b in zip(p0, p1) for r in (_run(10.0 * a, 0.6), _run(20.0 * b, 0.9))]
    out = bench.summarise(runs, base, n_prompts=2)
    assert out["per_prompt"] == pytest.approx([1.15, 2.15])  # grouping by halves would give 1.55 and 1.75
    assert out["per_prompt_acceptance"] == pytest.approx([0.6, 0.9])
    assert out["ratios"] == pytest.approx([x for pair in zip(p0, p1) for x in pair])
    assert out["vs_no_spec"] == pytest.approx(1.65)  # the pooled median lies between the prompts: neither's ratio


def test_baseline_has_no_per_prompt_ratios():
    bench = _bench()
    out = bench.summarise([_run(10.0), _run(20.0)], None, n_prompts=2)
    assert out["per_prompt"] is None and out["per_prompt_acceptance"] is None
