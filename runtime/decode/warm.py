"""Warm start: read every expert into the cache before decoding when the budget holds them all.

When every MoE layer's slots hold all of its experts, all of them are read (queued before the
prefill, so the reads overlap it; the decoder waits for the rest before its first step): no
decode-time misses at a 100% budget. Below that, decoding starts from the cache as it is: filling
a partial cache with a trace's most used experts first was measured within the noise of a cold
start (bench/results/warm.txt) and is not done.

Invariant: warming only changes what is resident when decoding starts, never what is computed.
"""

from __future__ import annotations

from storage import ExpertKey


def warm_keys(om, source: str | None = None) -> list[ExpertKey]:
    """The experts a warm start reads: all of them if every layer's slots hold its experts (earlier layers
    first), else none. `source` "off": none at all (a cold start, e.g. to measure what decoding reads from
    an empty cache); None: the rule above."""
    if source not in (None, "off"):
        raise ValueError(f"warm {source!r}; expected None (a full budget reads every expert first) or 'off'")
    if source == "off":
        return []
    n_experts = {l: om.store.layout(l).n_experts for l in om.moe_layers}
    if all(om.cache.usable_slots(l) >= n_experts[l] for l in om.moe_layers):
        return [ExpertKey(l, e) for l in om.moe_layers for e in range(n_experts[l])]
    return []


def warm_start(om, source: str | None = None) -> int:
    """Queue the warm start's reads (they overlap whatever runs next); returns how many."""
    return om.cache.warm(warm_keys(om, source))
