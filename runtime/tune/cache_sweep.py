"""`specmoe sweep cache`: replay a trace through policies and sizes (no model needed).

Per cache size (a share of each layer's experts): every policy's hit rate and MB
read per token, Belady's MIN as the bound, the default policy's misses against LRU
and Belady, and the per-layer slot split: equal slots per layer vs slots allocated
by per-layer miss curves of the default policy at the same total.
"""

from __future__ import annotations

from pathlib import Path

from runtime.cache import DEFAULT_POLICY, allocate_slots, belady, coarse_miss_curve, replay, windows_of
from runtime.observe import RoutingTrace


def cache_sweep(trace_path: Path, *, window: int, fractions: list[float], policies: list[str],
                forecast_recall: float = 0.9) -> dict:
    trace = RoutingTrace.load(trace_path)
    n, k = trace.n_experts, trace.top_k
    layers = [[s for s in trace.layer(i) if len(s)] for i in range(len(trace.moe_layers))]
    tokens = trace.n_tokens
    if not tokens:
        raise ValueError(f"{trace_path}: the trace has no tokens")
    expert_mb = trace.model.get("expert_bytes", 0) / 1e6
    lo = max(max((len(w) for w in windows_of(seqs, window)), default=k) for seqs in layers)
    curves = {i: coarse_miss_curve(seqs, n, lo, window) for i, seqs in enumerate(layers)}
    table = []
    for f in fractions:
        slots = max(lo, int(round(f * n)))
        row = {"fraction": f, "slots": slots}
        for p in policies + ["belady"]:
            results = [
                belady(seqs, slots, window) if p == "belady" else
                replay(seqs, n, slots, "lru" if p == "forecast" else p, window,
                       forecast_recall=forecast_recall if p == "forecast" else None)
                for seqs in layers
            ]
            hits, misses = sum(r.hits for r in results), sum(r.misses for r in results)
            row[p] = {"hit_rate": hits / max(1, hits + misses), "misses_per_token": misses / tokens,
                      "mb_per_token": misses * expert_mb / tokens}
        if "lru" in row and DEFAULT_POLICY in row:
            d, lru, opt = row[DEFAULT_POLICY], row["lru"], row["belady"]
            row["default_vs_lru"] = d["misses_per_token"] / lru["misses_per_token"] if lru["misses_per_token"] else 1.0
            row["default_vs_belady"] = d["misses_per_token"] / opt["misses_per_token"] if opt["misses_per_token"] else 1.0
        alloc = allocate_slots(curves, slots * len(layers), lo)
        equal_misses = sum(curves[i][slots] for i in curves)
        alloc_misses = sum(curves[i][alloc[i]] for i in curves)
        lookups = sum(sum(len(w) for w in windows_of(seqs, window)) for seqs in layers)
        row["split_equal"] = 1 - equal_misses / lookups
        row["split_allocated"] = 1 - alloc_misses / lookups
        row["split_slots"] = [alloc[i] for i in sorted(alloc)]
        table.append(row)
    return {"trace": str(trace_path), "model": trace.model, "window": window, "tokens": tokens, "default": DEFAULT_POLICY,
            "forecast_recall": forecast_recall, "table": table}
