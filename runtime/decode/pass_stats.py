"""PassStats: what a DevicePass (runtime/decode/device_pass.py) counts, for --json, benches and tests.

Invariants: counters only grow; host_syncs counts every host sync the pass's forwards made (1 per forward,
plus repairs, route syncs and synced layer calls).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class PassStats:
    passes: int = 0  # forwards run through the pass
    host_syncs: int = 0  # host syncs those forwards made (1 + repairs + route syncs + synced calls)
    repairs: int = 0  # recomputations after absent experts, from the first layer that missed
    multi_sync: int = 0  # passes that needed more than one host sync
    repair_reads: int = 0  # experts read by repairs
    wasted_reads: int = 0  # of those, experts the accepted forward did not use
    recomputed_layers: int = 0  # decoder layers run again by repairs
    layer_calls: int = 0  # MoE layer calls that looked up on the device
    bookkeeping_s: float = 0.0  # host time in flush() (recency, stats, observer, telemetry)
    next_built: int = 0  # forwards built before the previous one's sync (runtime/decode/next_forward.py)
    next_dropped: int = 0  # of those, dropped because the previous forward needed a repair
    routed: int = 0  # windows whose layers synced their routing before their experts (window_routes.py)
    route_syncs: int = 0  # host syncs those made (one per routed MoE layer)
    route_reads: int = 0  # experts they read before the layer that needed them ran

    def to_json(self) -> dict:
        return asdict(self)
