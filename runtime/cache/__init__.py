"""runtime.cache: the expert cache — which expert sits in which slot of unified memory.

Owns: the slot bookkeeping (`SlotTable`), eviction policies, `ExpertCache` (per-layer slabs filled
by the storage loader, pins, budget), `CachedSwitchGLU` (the drop-in for mlx-lm's `SwitchGLU` that
reads the slabs), memory budgets (`--budget`) and the `MemoryGovernor` that shrinks the cache under
memory pressure, and offline replay of routing traces through the same policy code (`replay`,
Belady's MIN `belady`, miss curves, and the per-layer slot split `split_by_miss_curves`).

Per MoE layer the cache also keeps a persistent device-side expert -> slot table (`device_tables`,
updated one entry per commit or eviction) that device passes look slots up in without a host sync
(runtime/cache/resident_tables.py).

Invariants kept at this boundary: a slot that a not-yet-evaluated graph reads is pinned (synced
path) or held (device passes) and never overwritten; a failed or corrupt read never leaves a slot valid; the slabs never exceed the budget.
"""

from runtime.cache.budget import (
    HEADROOM_FRACTION,
    HEADROOM_MIN_BYTES,
    BudgetPlan,
    BudgetSpec,
    format_bytes,
    kv_bytes_estimate,
    parse_budget,
    plan_budget,
)
from runtime.cache.cached_switch import CachedSwitchGLU
from runtime.cache.cache_stats import CallStats
from runtime.cache.context_governor import ContextGovernor
from runtime.cache.memory_limit import (
    DEFAULT_PREFILL_STEP,
    MemoryLimit,
    activation_bytes,
    apply_memory_limit,
    parse_memory_limit,
    process_peak_rss,
    process_rss,
    rss_peak_since_last,
)
from runtime.cache.expert_cache import ExpertCache
from runtime.cache.governor import GovernorConfig, MemoryGovernor
from runtime.cache.policy import DEFAULT_POLICY, POLICIES, make_policy
from runtime.cache.replay import ReplayResult, allocate_slots, belady, miss_curve, replay, windows_of
from runtime.cache.slab_switch import check_expert_module, slab_switch_glu
from runtime.cache.slot_split import coarse_miss_curve, split_by_miss_curves
from runtime.cache.slot_table import SlotTable

__all__ = [
    "HEADROOM_FRACTION", "HEADROOM_MIN_BYTES", "BudgetPlan", "BudgetSpec", "format_bytes", "kv_bytes_estimate",
    "parse_budget", "plan_budget", "CachedSwitchGLU", "ContextGovernor", "DEFAULT_PREFILL_STEP", "MemoryLimit",
    "activation_bytes", "apply_memory_limit", "parse_memory_limit", "process_rss", "process_peak_rss", "rss_peak_since_last", "CallStats", "ExpertCache",
    "GovernorConfig", "MemoryGovernor", "DEFAULT_POLICY", "POLICIES", "make_policy", "SlotTable", "check_expert_module", "slab_switch_glu",
    "ReplayResult", "allocate_slots", "belady", "miss_curve", "replay", "windows_of", "coarse_miss_curve",
    "split_by_miss_curves",
]
