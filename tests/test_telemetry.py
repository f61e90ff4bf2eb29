"""Telemetry is fed by the modules, agrees with the cache, and traces the emitted sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.plain import generate_tokens
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import run_speculative
from tests.conftest import PROMPT, run_cli


def test_plain_decode_rounds_match_cache_counters(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%", trace=True))
    try:
        ids = om.tokenizer.encode(PROMPT)
        om.telemetry.new_sequence()
        tokens, _ = generate_tokens(om.model, ids, max_tokens=10, om=om)
        tel = om.telemetry
        seqs = tel.trace_sequences()
        c = om.counters()
        assert sum(t.hits for t in tel.totals.values()) == c["hits"]
        assert sum(t.misses for t in tel.totals.values()) == c["misses"]
        assert sum(t.bytes_read for t in tel.totals.values()) == c["bytes_read"]
        # Every prompt token and every generated token went through the target once (mlx-lm's loop
        # computes the step after the last token it yields).
        assert len(seqs) == 1 and seqs[0].shape == (len(ids) + len(tokens), len(om.moe_layers), om.top_k)
        kinds = [r.kind for r in tel.rounds]
        assert kinds[0] == "prefill" and set(kinds[1:]) == {"decode"}
        for r in tel.rounds:
            for rec in r.layers.values():
                assert rec.n_pairs == rec.n_tokens * om.top_k and 1 <= rec.n_unique <= rec.n_pairs
                assert rec.hits + rec.misses >= rec.n_unique  # groups at small budgets may re-read
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_speculative_rounds_and_trace(family, tiny_dirs):
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="50%", trace=True))
    try:
        ids = om.tokenizer.encode(PROMPT)
        drafter, _ = load(str(tiny_dirs["qwen3_moe"]))  # unrelated to qwen3_next: exercises rejections
        om.telemetry.new_sequence()
        tokens, stats, _ = run_speculative(om, None, ids, max_tokens=12, num_draft=3, predictor="previous",
                                           cutoff=None, draft_model=drafter, draft_config=om.config,
                                           adaptive_k=False)  # every window K+1 = 4 tokens
        tel = om.telemetry
        verify = [r for r in tel.rounds if r.kind == "verify"]
        assert len(verify) == stats.n_rounds - stats.n_plain_rounds  # the last token, if alone, is a plain round
        assert sum(r.n_accepted for r in verify) == stats.n_accepted
        emitted = 0
        for r in verify:  # K + 1 = 4 tokens a window, cut to the tokens still wanted
            assert r.n_tokens == min(4, 12 - emitted)
            emitted += r.n_accepted + 1
        assert ([r.kind for r in tel.rounds].count("rerun") > 0) == (stats.n_reruns > 0)
        seqs = tel.trace_sequences()
        # prompt[:-1] in prefill, then per round the accepted prefix of the window; never rejected drafts.
        emitted_before_last_round = len(tokens) - (tokens[-1:] and 1)
        assert seqs[0].shape[0] == len(ids) - 1 + sum(r.n_accepted + 1 for r in verify) + stats.n_plain_rounds
        assert emitted_before_last_round <= seqs[0].shape[0]
        summary = tel.summary()
        assert summary["unique_per_layer_per_verify"] <= summary["pairs_per_layer_per_verify"]
    finally:
        om.close()


def test_profile_cli_end_to_end(tiny_dirs, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The river began in the hills.\n\nA function should do one thing.\n")
    out, png, trace = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "t.smtrace"
    code, stdout, err = run_cli(["profile", "-m", str(tiny_dirs["mixtral"]), "--prompts", str(prompts), "--json", str(out),
                                 "--plot", str(png), "--trace", str(trace), "--decode-tokens", "4", "-k", "4"])
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["summary"]["sequences"] == 2 and "overlap" in stdout and "unique experts per 5-token window" in stdout
    reads = report["reads"]  # demand misses, prefetch used/wasted and bytes per token, from the cache's counters
    assert reads["demand_misses_per_token"] * report["summary"]["tokens"] == pytest.approx(report["telemetry"]["misses"])
    assert reads["mb_read_per_token"] > 0 and "reads per token:" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    code, again, err = run_cli(["profile", "--trace", str(trace), "-k", "4"])
    assert code == 0 and again.splitlines()[-1] == stdout.splitlines()[-1]
    code, _, err = run_cli(["profile", "-m", str(tiny_dirs["mixtral"]), "--prompts", str(tmp_path / "none.txt")])
    assert code == 2 and "--prompts" in err and "not found" in err
    code, _, err = run_cli(["profile"])
    assert code == 2 and "--trace FILE" in err


def test_round_records_are_bounded_but_totals_are_not():
    from runtime.cache.expert_cache import CallStats
    from runtime.observe.telemetry import Telemetry

    tel = Telemetry([0, 1], max_rounds=10)
    call = [CallStats(3, 1, 0, 100, 0.5)]
    for _ in range(50):
        for layer in (0, 1):
            tel.on_call(layer, np.array([[1, 2, 3, 4]]), call)
    s = tel.summary()
    assert len(tel.rounds) == 10 and s["rounds"] == 50
    assert s["misses"] == 100 and s["bytes_read"] == 10_000 and tel.totals[0].misses == 50
    assert tel.summary(exclude=("decode",))["rounds"] == 0
