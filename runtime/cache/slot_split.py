"""Slots per layer from each layer's miss curve: the same total, split where it saves most reads.

The budget gives every MoE layer the same number of slots. Layers differ, though: one whose
routing concentrates on a few experts gains little from more slots, one that spreads gains a
lot. split_by_miss_curves() replays a routing trace of the model (`specmoe profile --trace`)
through the live cache's policy code for a range of slot counts per layer (a coarse grid,
interpolated) and hands out the same total greedily by largest saving (replay.allocate_slots).
It lives beside the policies it replays, in the cache package, so any layer above the cache may
use it (`specmoe sweep cache` in runtime.tune reports it).

Invariants: the total equals the total given; every layer keeps at least `minimum` slots and
at most its expert count; a layer the trace does not cover keeps its slots.
"""

from __future__ import annotations

import numpy as np

from runtime.cache.policy import DEFAULT_POLICY
from runtime.cache.replay import allocate_slots, replay


def coarse_miss_curve(seqs: list[np.ndarray], n: int, lo: int, window: int, policy: str = DEFAULT_POLICY,
                      points: int = 24) -> dict[int, int]:
    """`policy`'s misses for every slot count from lo to n (about `points` replays, linearly interpolated)."""
    step = max(1, (n - lo) // points)
    pts = sorted(set(range(lo, n + 1, step)) | {n})
    measured = {s: replay(seqs, n, s, policy, window).misses for s in pts}
    return {s: int(round(np.interp(s, pts, [measured[p] for p in pts]))) for s in range(lo, n + 1)}


def split_by_miss_curves(trace, slots: dict[int, int], minimum: int, *, window: int = 1,
                         policy: str = DEFAULT_POLICY) -> dict[int, int]:
    """Re-split sum(slots) over the layers `trace` (a RoutingTrace of this model) covers."""
    layers = [l for l in trace.moe_layers if l in slots]
    missing = [l for l in slots if l not in trace.moe_layers]
    if not layers:
        raise ValueError("the routing trace covers none of this model's MoE layers")
    n = trace.n_experts
    curves = {}
    for l in layers:
        seqs = [s for s in trace.layer(trace.moe_layers.index(l)) if len(s)]
        curves[l] = coarse_miss_curve(seqs, n, minimum, window, policy)
    alloc = allocate_slots(curves, sum(slots[l] for l in layers), minimum)
    return {**alloc, **{l: slots[l] for l in missing}}
