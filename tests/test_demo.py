"""`specmoe demo` end to end on the embedded pair, at a reduced length (the README's demo command)."""

from __future__ import annotations

import json

import pytest

from runtime.cli.demo import verdict
from tests.conftest import run_cli


def test_demo_runs_three_ways_with_identical_output(tmp_path):
    out = tmp_path / "demo.json"
    code, stdout, err = run_cli(["demo", "-n", "8", "--repeats", "2", "--json", str(out)])
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["identical_outputs"] is True and len(result["tokens"]) == 8
    assert [r["variant"] for r in result["rows"]] == ["plain", "spec, no prefetch", "spec + spmoe prefetch"]
    assert 0.3 < result["cache_fraction"] < 0.5  # ~40% of the experts
    spec = result["rows"][1]
    assert spec["acceptance"] is not None and spec["unique_per_layer_per_verify"] <= spec["pairs_per_layer_per_verify"]
    assert "outputs identical: yes" in stdout
    # MB read per token counts the prefetch reads too: only the forecasting variant prefetches.
    plain, nopf, spmoe = result["rows"]
    assert plain["prefetch_mb_per_token"] == 0 and nopf["prefetch_mb_per_token"] == 0
    assert 0 < spmoe["prefetch_mb_per_token"] <= spmoe["mb_read_per_token"]
    # Interleaved passes with their spread; "vs plain" is the ratio of the medians shown, and a verdict is given
    # only outside the spread (the range of ratios the two spreads allow excludes 1).
    assert result["repeats"] == 2
    plain_tps = result["rows"][0]["tokens_per_s"]
    for r in result["rows"]:
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] and len(r["tokens_per_s_passes"]) == 2
        assert r["vs_plain"] == pytest.approx(r["tokens_per_s"] / plain_tps)
        assert r["vs_plain_min"] <= r["vs_plain"] <= r["vs_plain_max"]
        expected = ("-" if r["variant"] == "plain" else "faster" if r["vs_plain_min"] > 1
                    else "slower" if r["vs_plain_max"] < 1 else "within noise")
        assert r["verdict"] == expected


@pytest.mark.parametrize("variant, plain, expected", [
    ([45.5, 44.0, 47.0], [42.1, 30.0, 50.0], "within noise"),  # 1.08x on the medians, inside plain's spread
    ([60.0, 58.0, 61.0], [42.1, 41.0, 43.0], "faster"),
    ([30.0, 31.0, 29.0], [42.1, 41.0, 43.0], "slower"),
    ([45.5], [42.1], "no spread (1 pass)"),
])
def test_a_verdict_needs_the_spreads_apart(variant, plain, expected):
    assert verdict(variant, plain) == expected


def test_the_verdict_agrees_with_the_numbers_beside_it(monkeypatch):
    """Passes that drift (plain 42.1, 30, 50; the variant 45.5, 41.7, 70): the medians are 45.5 vs 42.1, so the
    row reads 1.08x and "within noise"; the median of per-pass ratios (1.39, all > 1) said "1.39 faster"."""
    from runtime.cli import demo

    tps = {"plain": iter([42.1, 30.0, 50.0]), "spec, no prefetch": iter([45.5, 41.7, 70.0]),
           "spec + spmoe prefetch": iter([40.0, 41.0, 39.0])}

    def fake_pass(target, draft, prompt, max_tokens, budget, num_draft, io_mode, variants):
        rows = {name: {"variant": name, "tokens_per_s": next(tps[name])} for name, _ in variants}
        return {"rows": rows, "texts": {"plain": ""}, "tokens": {name: [1, 2] for name, _ in variants},
                "cache_fraction": 0.4}

    monkeypatch.setattr(demo, "run_variants", fake_pass)
    rows = {r["variant"]: r for r in demo.run_demo(None, None, "p", 2, "40%", 3, "buffered", repeats=3)["rows"]}
    spec = rows["spec, no prefetch"]
    assert spec["vs_plain"] == pytest.approx(45.5 / 42.1) and spec["verdict"] == "within noise"
    assert rows["spec + spmoe prefetch"]["verdict"] == "within noise"  # 40 vs 42.1, spreads overlap
