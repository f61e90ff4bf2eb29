"""`specmoe demo` end to end on the embedded pair, at a reduced length (the README's demo command)."""

from __future__ import annotations

import json

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
    # Interleaved passes with their spread; a verdict only when every pass agrees.
    assert result["repeats"] == 2
    for r in result["rows"]:
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["vs_plain_min"] <= r["vs_plain"] <= r["vs_plain_max"]
        expected = ("-" if r["variant"] == "plain" else "faster" if r["vs_plain_min"] > 1
                    else "slower" if r["vs_plain_max"] < 1 else "within the noise")
        assert r["verdict"] == expected
