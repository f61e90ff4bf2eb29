"""MemoryGovernor: shrink the expert cache when the machine runs short of memory, grow it back later.

Why: the budget is fixed at load time from what was free then. Other programs can
take memory afterwards; a Mac then compresses and swaps until it stalls (peers
report swap death and kernel panics). Expert slots are the one large allocation
we can give back without changing any output, so we give them back first.

Signal: available memory (psutil.virtual_memory().available; on Linux capped by what is left under the
process's cgroup limit, runtime/cache/cgroup_memory.py) and, on macOS, the
kernel's pressure level (sysctl kern.memorystatus_vm_pressure_level: 1 normal,
2 warn, 4 critical), read through libc with ctypes: no extra dependency.

Decision (`decide`, a pure function of one reading and the current level): a
level in [0, 1] sets every layer's usable slots to
    floor + round(level * (n_slots - floor)),  floor = the model's top-k.
- critical pressure: level 0 at once;
- available < low_bytes, or pressure warn: level -= step;
- available > high_bytes and no pressure: level += step;
- in between: hold. The gap between low and high is the hysteresis that keeps
  the cache from oscillating when memory hovers near one threshold.

What a shrink frees, exactly: on Linux the pages of the slots beyond the usable
range go back to the OS (madvise MADV_DONTNEED; `bytes_released` counts them and RSS
drops). On macOS nothing is returned: the slabs are Metal shared buffers allocated
once, release_pages() reports 0, and a shrink only evicts the experts beyond the
usable range and stops filling those slots -- the process footprint stays the same
(the untouched pages may be compressed or swapped by the OS like any idle memory,
not measured here: no Mac). `counters()["returns_memory"]` says which case applies.

Invariants: usable slots stay within [top-k, budget slots]; the governor only
*requests* sizes and ExpertCache applies them where no call is in progress, so a
resize never races a forward pass; tokens are unchanged by any resize (only what
is resident changes). A failing reading is logged and skipped, never fatal.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Callable

import psutil

from runtime.cache.slab import pages_returnable

log = logging.getLogger(__name__)

_GiB = 1 << 30


@dataclass(frozen=True)
class GovernorConfig:
    low_bytes: int | None = None  # shrink below this much available memory (None: max(1 GiB, 10% of RAM))
    high_bytes: int | None = None  # grow back above this (None: low + max(512 MiB, 5% of RAM))
    step: float = 0.25  # share of the shrinkable slots released (or restored) per reading
    interval_s: float = 1.0  # seconds between readings

    def __post_init__(self):
        if not 0 < self.step <= 1:
            raise ValueError(f"GovernorConfig.step={self.step}; expected 0 < step <= 1")
        if self.interval_s <= 0:
            raise ValueError(f"GovernorConfig.interval_s={self.interval_s}; expected > 0")
        if self.low_bytes is not None and self.high_bytes is not None and self.high_bytes < self.low_bytes:
            raise ValueError(f"GovernorConfig.high_bytes={self.high_bytes} < low_bytes={self.low_bytes}; expected high >= low")

    def thresholds(self, total_bytes: int) -> tuple[int, int]:
        low = self.low_bytes if self.low_bytes is not None else max(_GiB, total_bytes // 10)
        high = self.high_bytes if self.high_bytes is not None else low + max(_GiB // 2, total_bytes // 20)
        return low, high


@dataclass(frozen=True)
class MemoryReading:
    available_bytes: int  # memory the OS can hand out without swapping
    total_bytes: int  # physical memory
    pressure: str | None = None  # macOS kernel level: "normal", "warn", "critical"; None where unknown


def _macos_pressure() -> str | None:
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        if libc.sysctlbyname(b"kern.memorystatus_vm_pressure_level", ctypes.byref(value), ctypes.byref(size), None, 0):
            return None
    except (OSError, AttributeError):
        return None
    return {1: "normal", 2: "warn", 4: "critical"}.get(value.value)


def read_memory() -> MemoryReading:
    """RAM's available and total, each capped by the process's cgroup (Linux): inside a cap, what is left of it."""
    from runtime.cache.cgroup_memory import cgroup_available_bytes, cgroup_limit_bytes

    vm = psutil.virtual_memory()
    pressure = _macos_pressure() if sys.platform == "darwin" else None
    available, total = int(vm.available), int(vm.total)
    limit, left = cgroup_limit_bytes(), cgroup_available_bytes()
    return MemoryReading(min(available, left) if left is not None else available,
                         min(total, limit) if limit is not None else total, pressure)


def decide(reading: MemoryReading, level: float, cfg: GovernorConfig) -> float:
    """The next level in [0, 1] given one reading (see the module docstring)."""
    low, high = cfg.thresholds(reading.total_bytes)
    if reading.pressure == "critical":
        return 0.0
    if reading.available_bytes < low or reading.pressure == "warn":
        return max(0.0, level - cfg.step)
    if reading.available_bytes > high:
        return min(1.0, level + cfg.step)
    return level


@dataclass
class GovernorStats:
    n_readings: int = 0  # readings taken
    n_shrinks: int = 0  # readings that lowered the level
    n_grows: int = 0  # readings that raised it
    n_errors: int = 0  # readings that failed (skipped)
    level: float = 1.0  # current level: 1 = the full budget, 0 = top-k slots per layer
    available_bytes: int = 0  # last reading
    pressure: str | None = None  # last reading (macOS)

    def to_json(self) -> dict:
        return asdict(self)


class MemoryGovernor:
    """Polls memory on a daemon thread and resizes the cache's usable slots."""

    def __init__(self, cache, cfg: GovernorConfig = GovernorConfig(), read: Callable[[], MemoryReading] = read_memory):
        self.cache = cache  # ExpertCache: request_usable_slots(), min_usable, n_slots()
        self.cfg = cfg
        self.stats = GovernorStats()
        self._read = read
        self.ceiling: int | None = None  # usable slots per layer another rule allows at most (ContextGovernor)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def usable_for(self, level: float) -> dict[int, int]:
        """Usable slots per layer at `level`."""
        out = {}
        for layer in self.cache.layers():
            n = self.cache.n_slots(layer)
            floor = min(self.cache.min_usable, n)
            out[layer] = floor + round(level * (n - floor))
            if self.ceiling is not None:
                out[layer] = min(out[layer], max(floor, self.ceiling))
        return out

    def tick(self) -> float:
        """Take one reading and request the matching cache size; returns the level."""
        try:
            reading = self._read()
        except Exception as e:  # a monitor must not take the run down
            self.stats.n_errors += 1
            log.warning("memory reading failed: %s", e)
            return self.stats.level
        s = self.stats
        s.n_readings += 1
        s.available_bytes, s.pressure = reading.available_bytes, reading.pressure
        level = decide(reading, s.level, self.cfg)
        if level != s.level:
            if level < s.level:
                s.n_shrinks += 1
                log.info("available memory %d MB (pressure %s): expert cache down to level %.2f",
                         reading.available_bytes >> 20, reading.pressure, level)
            else:
                s.n_grows += 1
            s.level = level
            self.cache.request_usable_slots(self.usable_for(level))
        return level

    def counters(self) -> dict[str, float]:
        """Numbers for OffloadedModel.counters(): governor decisions and what the cache applied."""
        r = self.cache.resize_stats
        return {"governor_shrinks": self.stats.n_shrinks, "governor_grows": self.stats.n_grows,
                "usable_slots": self.cache.total_usable_slots(),
                "resize_evicted": r.n_evicted, "bytes_released": r.bytes_released,
                "returns_memory": int(pages_returnable())}

    # -- the thread --------------------------------------------------------------------
    def start(self) -> "MemoryGovernor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specmoe-memory-governor", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
