"""The plan for Qwen3-30B-A3B and Qwen3.5-35B-A3B on a 16 GB M4, cost model v1 (before) against v2
(after), term by term. v2 prices the engine's default (`one_sync="auto"`: below a full budget, one host
sync per MoE layer + 1 per token); the last column prices device passes at every budget (`one_sync="on"`,
one sync per forward + repairs), v2's count before the default changed. Projections only (no
measurement): deterministic, so one run suffices.

Run: python bench/plan_before_after.py   (table, then one JSON line)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.cli.plan import build_plan  # noqa: E402

MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b")


def terms(plan: dict) -> dict:
    base, spec = plan["projections"][0], plan["projections"][3]
    step = base["step"]
    return {
        "baseline_tok_s": round(base["tok_per_s"], 2), "baseline_ms": round(base["ms_per_token"], 1),
        "dense_ms": round(step["dense_ms"], 1), "experts_ms": round(step["expert_compute_ms"], 1),
        "io_ms": round(step["page_cache_ms"] + step["ssd_ms"], 1), "fixed_ms": round(step["sync_ms"], 1),
        "repair_ms": round(step.get("repair_ms", 0.0), 1), "host_syncs": step.get("host_syncs") or None,
        "prefetch_tok_s": round(plan["projections"][1]["tok_per_s"], 2),
        "spec_prefetch_tok_s": round(spec["tok_per_s"], 2),
        "spec_speedup": round(plan["projections"][2]["spec"]["speedup"], 2),
        "verify_syncs": plan["projections"][3]["step"].get("host_syncs") or None,
        "draft_ratio": round(plan["projections"][2]["spec"]["draft_ratio"], 2),
        "hit_for_10": plan["required_hit_rate"].get("baseline"),
        "ttft_s_1000": (plan.get("prefill") or {}).get("ttft_s"),
        "max_context": plan.get("max_context_tokens"),
    }


def main() -> dict:
    record = {"bench": "plan_before_after", "mac": "m4-16gb", "kind": "projection", "models": {}}
    rows = []
    for model in MODELS:
        before = terms(build_plan(model_ref=model, mac_name="m4-16gb", cost_model="v1"))
        after = terms(build_plan(model_ref=model, mac_name="m4-16gb", cost_model="v2"))
        fast = terms(build_plan(model_ref=model, mac_name="m4-16gb", cost_model="v2", fast_synch=True))
        passes = terms(build_plan(model_ref=model, mac_name="m4-16gb", cost_model="v2", one_sync="on"))
        record["models"][model] = {"v1": before, "v2": after, "v2_fast_synch": fast, "v2_one_sync_on": passes}
        for key in before:
            rows.append((model, key, before[key], after[key], fast[key], passes[key]))
    print(f"{'model':16s} {'term':20s} {'v1 (before)':>12s} {'v2 (after)':>12s} {'v2 fast-synch':>14s} "
          f"{'v2 one-sync on':>15s}")
    for model, key, a, b, c, d in rows:
        print(f"{model:16s} {key:20s} {str(a):>12s} {str(b):>12s} {str(c):>14s} {str(d):>15s}")
    print("every figure is a projection of the planner's cost model (specmoe plan --mac m4-16gb), not a measurement")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
