"""What the expert cache reports: per call (CallStats) and per resize of the memory governor (ResizeStats).

Plain counters; ExpertCache fills them under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallStats:
    hits: int  # unique experts already valid or loading
    misses: int  # unique experts read on demand
    prefetch_used: int  # hits on experts a prefetch brought in (or was bringing in)
    bytes_read: int  # bytes of the demand reads
    stall_ms: float  # time blocked waiting for reads (demand misses and in-flight prefetches)


@dataclass
class ResizeStats:
    n_shrinks: int = 0  # per-layer resizes that lowered the usable slots
    n_grows: int = 0  # per-layer resizes that raised them
    n_evicted: int = 0  # experts evicted because their slot left the usable range
    bytes_released: int = 0  # slab bytes handed back to the OS (0 where unsupported)
