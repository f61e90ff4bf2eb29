"""metal: the dedup verify kernel, its launcher and the reference path it is tested against.

`moe_verify` / `moe_verify_reference` compute a MoE layer over a window from cache
slabs; `dedup_switch_glu` is the drop-in for `SwitchGLU.__call__` (kernel or grouped
reference); `window_switch_glu`, what the cache-backed module calls for multi-token
windows, takes it where the kernel runs and the stock switch elsewhere;
`window_stats` counts pairs and unique experts.
"""

from metal.dedup_verify import (
    KERNEL_GATE,
    dedup_switch_glu,
    group_by_expert,
    kernel_would_run,
    moe_verify,
    moe_verify_reference,
    window_stats,
    window_switch_glu,
)

__all__ = [
    "KERNEL_GATE",
    "dedup_switch_glu",
    "group_by_expert",
    "kernel_would_run",
    "moe_verify",
    "moe_verify_reference",
    "window_stats",
    "window_switch_glu",
]
