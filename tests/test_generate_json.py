"""`specmoe generate --json`: one schema for plain and speculative runs (docs/json.md).

Runs the embedded pair plainly and with its drafter and checks both files with one function:
the same top-level keys, the same `stats` keys (runtime.api's RunStats), sane values, the
drafter's settings filled in (cutoff as the MoE layer count when every layer is prefetched), and
the decoder's counters agreeing with the governor's. The checker is shown to reject the shape the
command wrote before (decoder records under `stats`, a null cutoff, usable slots counted as a delta).
"""

from __future__ import annotations

import json

import pytest

from runtime.checkpoints import embedded_pair
from tests.conftest import run_cli

PROMPT = "Enter the king, with his lords."
TOP = {"model", "budget", "budget_bytes", "slots", "policy", "draft", "num_draft", "predictor", "cutoff", "stats",
       "detail", "governor", "tokens", "text"}
STATS = {"tokens_per_s", "generation_tps", "prompt_tps", "hit_rate", "misses_per_token", "prefetch_reads_per_token",
         "mb_read_per_token", "host_syncs_per_token", "bytes_read", "misses", "prompt_tokens", "generation_tokens",
         "acceptance", "peak_memory_gb", "prefill", "decode", "speculative"}
PHASE = {"tokens", "seconds", "tokens_per_s", "hit_rate", "misses", "prefetch_reads", "bytes_read", "host_syncs"}
SPECULATIVE = {"rounds", "drafted", "accepted", "plain_rounds", "tokens_per_verify", "mean_k", "cutoff",
               "forecast_recall"}


def schema_problems(result: dict, n_moe_layers: int) -> list[str]:
    """What in a `generate --json` result breaks docs/json.md's schema (empty: none)."""
    bad = [f"top-level keys: missing {sorted(TOP - result.keys())}"] if TOP - result.keys() else []
    stats = result.get("stats", {})
    if stats.keys() != STATS:
        return bad + [f"stats keys: missing {sorted(STATS - stats.keys())}, extra {sorted(stats.keys() - STATS)}"]
    for phase in ("prefill", "decode"):
        if stats[phase].keys() != PHASE:
            bad.append(f"stats.{phase} keys {sorted(stats[phase])}")
    n = len(result["tokens"])
    if stats["generation_tokens"] != n or stats["decode"]["tokens"] != n - 1:
        bad.append(f"token counts: {stats['generation_tokens']}, decode {stats['decode']['tokens']}, {n} tokens")
    if not (stats["tokens_per_s"] > 0 and 0 <= stats["hit_rate"] <= 1 and stats["host_syncs_per_token"] > 0):
        bad.append(f"rates: {stats['tokens_per_s']}, {stats['hit_rate']}, {stats['host_syncs_per_token']}")
    if stats["bytes_read"] != stats["prefill"]["bytes_read"] + stats["decode"]["bytes_read"]:
        bad.append("bytes_read is not prefill + decode")
    if result["draft"] is None:
        if stats["speculative"] is not None or stats["acceptance"] is not None or result["cutoff"] is not None:
            bad.append("a plain run with speculative numbers")
    else:
        spec = stats["speculative"] or {}
        if spec.keys() != SPECULATIVE:
            bad.append(f"stats.speculative keys {sorted(spec)}")
        elif not (isinstance(result["cutoff"], int) and 0 <= result["cutoff"] <= n_moe_layers
                  and spec["cutoff"] == result["cutoff"] and spec["rounds"] >= 1 and 0 <= stats["acceptance"] <= 1
                  and spec["tokens_per_verify"] == pytest.approx(n / spec["rounds"])):
            bad.append(f"speculative: cutoff {result['cutoff']!r} (of {n_moe_layers}), {spec}")
        usable = result["detail"].get("counters", {}).get("usable_slots")
        if result["governor"] is not None and usable != result["governor"]["usable_slots"]:
            bad.append(f"counters.usable_slots {usable} but governor.usable_slots {result['governor']['usable_slots']}")
    if result["governor"] is not None and result["governor"]["usable_slots"] != sum(result["slots"].values()):
        bad.append("governor.usable_slots is not the plan's slots (no memory pressure here)")
    return bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pair, out = embedded_pair(), tmp_path_factory.mktemp("json")
    results = {}
    for name, extra in (("plain", []), ("speculative", ["--draft", str(pair.default_drafter)])):
        path = out / f"{name}.json"
        code, _, err = run_cli(["generate", "-m", str(pair.target), "-p", PROMPT, "-n", "12", "--budget", "50%",
                                "--raw-prompt", "--json", str(path), *extra])
        assert code == 0, err
        results[name] = json.loads(path.read_text())
    n_moe = json.loads((pair.target / "config.json").read_text())["num_hidden_layers"]  # every layer is MoE here
    return results, n_moe


def test_plain_and_speculative_runs_write_one_schema(runs):
    results, n_moe = runs
    plain, spec = results["plain"], results["speculative"]
    assert schema_problems(plain, n_moe) == [] and schema_problems(spec, n_moe) == []
    assert plain.keys() == spec.keys() and plain["stats"].keys() == spec["stats"].keys()
    assert plain["tokens"] == spec["tokens"]  # lossless either way
    assert spec["cutoff"] == n_moe  # the default prefetches every MoE layer: said as the count, not null
    assert spec["stats"]["prefetch_reads_per_token"] > 0  # the drafter's forecasts are read ahead, and counted


def test_the_check_rejects_the_earlier_shape(runs):
    """Decoder records under "stats" (different keys per decoder), a null cutoff and usable slots
    counted as a delta (0 while the governor says 256) each fail the check."""
    results, n_moe = runs
    old_plain = {**results["plain"], "stats": results["plain"]["detail"]}
    assert any(p.startswith("stats keys") for p in schema_problems(old_plain, n_moe))
    null_cutoff = {**results["speculative"], "cutoff": None}
    assert any(p.startswith("speculative: cutoff None") for p in schema_problems(null_cutoff, n_moe))
    detail = results["speculative"]["detail"]
    delta = {**results["speculative"], "detail": {**detail, "counters": {**detail["counters"], "usable_slots": 0}}}
    assert any(p.startswith("counters.usable_slots 0") for p in schema_problems(delta, n_moe))
