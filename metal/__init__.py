"""metal: the dedup verify kernel, its launcher and the reference path it is tested against.

`moe_verify` / `moe_verify_reference` compute a MoE layer over a window from cache
slabs; `dedup_switch_glu` is the drop-in for `SwitchGLU.__call__` that the cache-backed
module uses for multi-token calls; `window_stats` counts pairs and unique experts.
"""

from metal.dedup_verify import (
    KERNEL_GATE,
    dedup_switch_glu,
    group_by_expert,
    moe_verify,
    moe_verify_reference,
    window_stats,
)

__all__ = [
    "KERNEL_GATE",
    "dedup_switch_glu",
    "group_by_expert",
    "moe_verify",
    "moe_verify_reference",
    "window_stats",
]
