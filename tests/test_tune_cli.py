"""`specmoe sweep cutoff`, `sweep cache`, `tune`, and generate using tuning.json."""

from __future__ import annotations

import json

import pytest

from runtime.checkpoints.tiny import make_tiny
from tests.conftest import TINY, run_cli


@pytest.fixture(scope="module")
def pair(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    import shutil

    target = root / "target"
    shutil.copytree(tiny_dirs["qwen3_moe"], target)  # tune writes tuning.json next to the model
    drafter = make_tiny(root / "drafter", "qwen3", seed=7, layers=TINY["layers"])
    prompts = root / "prompts.txt"
    prompts.write_text("The river began in the hills.\nA function should do one thing.\n")
    return target, drafter, prompts


def test_sweep_cache_from_a_trace(pair, tmp_path):
    target, _, prompts = pair
    trace = tmp_path / "t.smtrace"
    assert run_cli(["profile", "-m", str(target), "--prompts", str(prompts), "--trace", str(trace)])[0] == 0
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    code, stdout, err = run_cli(["sweep", "cache", "--trace", str(trace), "--sizes", "25,50,100", "--json", str(out),
                                 "--plot", str(png)])
    assert code == 0, err
    rows = json.loads(out.read_text())["table"]
    assert [r["slots"] for r in rows] == [8, 16, 32]
    for r in rows:
        for p in ("lru", "lfu", "forecast"):
            assert r["belady"]["hit_rate"] >= r[p]["hit_rate"] - 1e-9
    assert rows[-1]["lru"]["hit_rate"] >= rows[0]["lru"]["hit_rate"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run_cli(["sweep", "cache", "--trace", str(trace), "--policies", "fifo"])
    assert code == 2 and "--policies 'fifo'" in err


@pytest.mark.slow
def test_tune_writes_tuning_json_that_generate_uses(pair, tmp_path):
    target, drafter, prompts = pair
    code, stdout, err = run_cli(["tune", "-m", str(target), "--draft", str(drafter), "--prompts", str(prompts), "--measure-tokens", "6",
                                 "--json", str(tmp_path / "t.json")])
    assert code == 0, err
    tuned = json.loads((target / "tuning.json").read_text())["entries"][0]["setting"]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["chosen"] == tuned and len(report["measured"]) >= 3
    code, _, err = run_cli(["generate", "-m", str(target), "-p", "hi", "-n", "4", "--draft", str(drafter),
                            "--json", str(tmp_path / "g.json")])
    assert code == 0 and "using tuned settings" in err
    g = json.loads((tmp_path / "g.json").read_text())
    assert (g["num_draft"], g["predictor"], g["cutoff"], g["policy"]) == (
        tuned["num_draft"], tuned["predictor"], tuned["cutoff"], tuned["policy"])
    code, _, err = run_cli(["generate", "-m", str(target), "-p", "hi", "-n", "4", "--draft", str(drafter), "--budget", "25%"])
    assert code == 0 and "no entry for this drafter, budget '25%'" in err


@pytest.mark.slow
def test_sweep_cutoff_repeats_passes_and_reports_their_spread(pair, tmp_path):
    target, drafter, prompts = pair
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    code, stdout, err = run_cli(["sweep", "cutoff", "-m", str(target), "--draft", str(drafter), "--prompts", str(prompts),
                                 "--measure-tokens", "4", "--repeats", "2", "--json", str(out), "--plot", str(png)])
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["measured"] and all(m["n_passes"] == 2 for m in report["measured"])
    assert all(m["tokens_per_s_min"] <= m["tokens_per_s"] <= m["tokens_per_s_max"] for m in report["measured"])
    assert "pass(es)" in report["reason"] and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_tune_at_a_budget_holding_every_expert_says_prefetch_does_not_apply(pair, tmp_path):
    target, drafter, prompts = pair
    code, stdout, err = run_cli(["tune", "-m", str(target), "--draft", str(drafter), "--prompts", str(prompts), "--measure-tokens", "4",
                                 "--budget", "100%", "--json", str(tmp_path / "t.json")])
    assert code == 0, err
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["prefetch_applies"] is False and "prefetch does not apply" in report["reason"]
    assert all(m["setting"]["cutoff"] == 0 for m in report["measured"]) and "prefetch does not apply" in err


@pytest.mark.slow
def test_tune_at_a_partial_budget_labels_emulated_reads_and_records_four_settings(pair, tmp_path):
    """At 25% a hidden --inject latency reaches every measured run and is labelled EMULATED; the settings the tuner
    records are cutoff, predictor, K and policy only."""
    target, drafter, prompts = pair
    code, stdout, err = run_cli(["tune", "-m", str(target), "--draft", str(drafter), "--prompts", str(prompts), "--measure-tokens", "4",
                                 "--budget", "25%", "--inject", "slow:ms=0.2", "--json", str(tmp_path / "t.json")])
    assert code == 0, err
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["inject"] == "slow:ms=0.2" and "EMULATED" in err
    settings = [m["setting"] for m in report["measured"]]
    assert len(settings) > 1 and all(set(s) == {"cutoff", "predictor", "num_draft", "policy"} for s in settings)
    assert set(report["chosen"]) == {"cutoff", "predictor", "num_draft", "policy"}
