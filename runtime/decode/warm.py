"""Warm start: read experts into the cache before decoding, so decode does not start cold.

When the budget holds every expert of every layer, all of them are read (queued before the
prefill, so the reads overlap it; the decoder waits for the rest before its first step): no
decode-time misses at a 100% budget. For smaller budgets a source names the most used
experts: a routing trace (.smtrace, `specmoe profile`/`--trace`) or a JSON file with
"expert_counts": {layer: [count per expert]} (or tuning.json from `specmoe tune`: the counts its measurements saw, for this model); each layer
gets its most used experts, as many as its slots hold.

Invariant: warming only changes what is resident when decoding starts, never what is computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from storage import ExpertKey


def expert_counts(om, source: str | Path) -> dict[int, np.ndarray]:
    """Per MoE layer, how often each expert was used according to `source`; ValueError if unusable."""
    path = Path(source)
    n_experts = {l: om.store.layout(l).n_experts for l in om.moe_layers}
    if path.suffix == ".smtrace":
        from runtime.observe import RoutingTrace

        trace = RoutingTrace.load(path)
        if sorted(trace.moe_layers) != om.moe_layers or trace.n_experts != max(n_experts.values()):
            raise ValueError(f"--warm {path}: the trace was recorded on another model "
                             f"(layers {trace.moe_layers}, {trace.n_experts} experts); expected this model's")
        return {l: np.bincount(np.concatenate([s.reshape(-1) for s in trace.layer(i)]).astype(np.int64),
                               minlength=n_experts[l])[: n_experts[l]]
                for i, l in enumerate(trace.moe_layers)}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--warm {path}: cannot read it ({e}); expected a routing trace (.smtrace) or a JSON file") from None
    counts = data.get("expert_counts") if isinstance(data, dict) else None
    if counts is None and isinstance(data, dict) and isinstance(data.get("entries"), list):
        counts = _tuned_counts(om, data["entries"])  # tuning.json: the entries for this model
    if not isinstance(counts, dict):
        raise ValueError(f"--warm {path}: no \"expert_counts\" in it (for a tuning.json: none for this model; rerun "
                         f"specmoe tune); expected a routing trace (.smtrace), a tuning.json or a JSON file with "
                         f"\"expert_counts\": {{layer: [count per expert]}}")
    out = {}
    for l in om.moe_layers:
        row = np.asarray(counts.get(str(l), counts.get(l, [])), np.float64)
        if row.shape != (n_experts[l],):
            raise ValueError(f"--warm {path}: expert_counts[{l}] has {row.size} entries; expected {n_experts[l]}")
        out[l] = row
    return out


def _tuned_counts(om, entries: list) -> dict | None:
    """Summed expert_counts of the tuning entries made for this model (any drafter, budget or machine:
    routing depends on the model and the text only), or None."""
    digest = om.model_id()["digest"]
    rows = [e["expert_counts"] for e in entries if isinstance(e, dict) and isinstance(e.get("expert_counts"), dict)
            and isinstance(e.get("key"), dict) and e["key"].get("model") == digest]
    if not rows:
        return None
    total = {}
    for row in rows:
        for layer, counts in row.items():
            c = np.asarray(counts, np.float64)
            total[layer] = total[layer] + c if layer in total and total[layer].shape == c.shape else c
    return total


def warm_keys(om, source: str | Path | None = None) -> list[ExpertKey]:
    """The experts a warm start reads: all of them if every layer's slots hold its experts, else each
    layer's most used per `source` (none without one), earlier layers first. `source` "off": none at all
    (a cold start, e.g. to measure what decoding reads from an empty cache)."""
    if source == "off":
        return []
    slots = {l: om.cache.usable_slots(l) for l in om.moe_layers}
    n_experts = {l: om.store.layout(l).n_experts for l in om.moe_layers}
    if all(slots[l] >= n_experts[l] for l in om.moe_layers):
        return [ExpertKey(l, e) for l in om.moe_layers for e in range(n_experts[l])]
    if source is None:
        return []
    counts = expert_counts(om, source)
    return [ExpertKey(l, int(e)) for l in om.moe_layers
            for e in np.argsort(-counts[l], kind="stable")[: slots[l]] if counts[l][e] > 0]


def warm_start(om, source: str | Path | None = None) -> int:
    """Queue the warm start's reads (they overlap whatever runs next); returns how many."""
    return om.cache.warm(warm_keys(om, source))
