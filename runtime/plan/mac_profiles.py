"""Mac hardware profiles: the machine numbers the planner's cost model needs.

A `MacProfile` is a frozen record of one machine: RAM, GPU working set, unified-memory
bandwidth, GPU TFLOPS, SSD and page-cache read bandwidth, plus the source of every number.
Profiles come from two places:
- `mac_profile("m4-16gb")` builds one from the chip table in `data/macs.json` (published figures,
  each with a source key from shared/reference/mac-and-models.md);
- `measured_profile(...)` builds one from numbers measured on the machine at hand, so a bench can
  feed the same cost model with this machine's bandwidths and compare predicted with measured.

Invariants: bandwidths and sizes are positive; the working set never exceeds RAM; bytes are
bytes (RAM is GiB-based as Apple sells it, bandwidths are decimal GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["MacProfile", "mac_profile", "measured_profile", "known_chips", "working_set_fraction"]

GIB = 1 << 30
MIB = 1 << 20
_DATA_PATH = Path(__file__).parent.parent / "data" / "macs.json"
# "m4-16gb", "m4pro-24gb", "m4-pro-24gb", "M3 Max-48GB": chip generation, tier, RAM in GB.
_NAME_RE = re.compile(r"^(m[1-9])[-_ ]?(pro|max)?[-_ ](\d+)\s*gb$")


@dataclass(frozen=True)
class MacProfile:
    name: str  # canonical id, e.g. "m4-16gb"
    label: str  # human label, e.g. "Apple M4, 16 GB RAM, 256 GB SSD"
    ram_bytes: int  # installed unified memory
    gpu_working_set_bytes: int  # Metal recommendedMaxWorkingSetSize (or the iogpu.wired_limit_mb override)
    mem_bandwidth_gbps: float  # peak unified-memory bandwidth, GB/s
    gpu_tflops: float  # GPU FP32 (= FP16 on these parts) TFLOPS
    ssd_capacity_gb: int  # internal SSD size the SSD figure applies to
    ssd_read_gbps: float  # internal SSD read bandwidth for expert-sized preads, GB/s
    page_cache_read_gbps: float  # pread bandwidth when the pages are already in the OS page cache, GB/s
    os_reserved_bytes: int  # RAM macOS and other apps keep; the rest may hold the page cache
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # field name -> where its number came from

    def __post_init__(self) -> None:
        for name in ("ram_bytes", "gpu_working_set_bytes", "ssd_capacity_gb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MacProfile.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("mem_bandwidth_gbps", "gpu_tflops", "ssd_read_gbps", "page_cache_read_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MacProfile.{name} must be > 0, got {getattr(self, name)!r}")
        if self.gpu_working_set_bytes > self.ram_bytes:
            raise ValueError(
                f"MacProfile.gpu_working_set_bytes {self.gpu_working_set_bytes} exceeds "
                f"ram_bytes {self.ram_bytes}"
            )
        if not 0 <= self.os_reserved_bytes < self.ram_bytes:
            raise ValueError(f"MacProfile.os_reserved_bytes out of range: {self.os_reserved_bytes!r}")


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    with open(_DATA_PATH, encoding="utf-8") as handle:
        return json.load(handle)


def known_chips() -> list[str]:
    """Chip ids in the table, e.g. ["m1", "m1pro", ..., "m4max"]."""
    return sorted(_table()["chips"])


def working_set_fraction(ram_gib: float) -> tuple[float, str]:
    """Default Metal working set as a fraction of RAM, and its source."""
    for rule in _table()["gpu_working_set"]["rules"]:
        if rule["max_ram_gib"] is None or ram_gib <= rule["max_ram_gib"]:
            return float(rule["fraction_of_ram"]), rule["source"]
    raise AssertionError("macs.json gpu_working_set rules must end with an open-ended rule")


def _ssd_entry(chip: dict[str, Any], capacity_gb: int) -> dict[str, Any]:
    # Entries are sorted by capacity, the last open-ended; pick the first that covers the size.
    for entry in chip["ssd_read_gbps"]:
        if entry["max_capacity_gb"] is None or capacity_gb <= entry["max_capacity_gb"]:
            return entry
    raise AssertionError("macs.json ssd_read_gbps lists must end with an open-ended entry")


def parse_mac_name(name: str) -> tuple[str, int]:
    """Split "m4-16gb" / "m4pro-24gb" into (chip id, RAM GiB); ValueError on anything else."""
    match = _NAME_RE.match(name.strip().lower())
    if match is None:
        raise ValueError(
            f"--mac {name!r} is not of the form CHIP-RAMgb, e.g. m4-16gb, m1pro-16gb, m3max-48gb"
        )
    generation, tier, ram_text = match.groups()
    chip_id = generation + (tier or "")
    if chip_id not in _table()["chips"]:
        raise ValueError(f"--mac {name!r}: unknown chip {chip_id!r}; known: {', '.join(known_chips())}")
    ram_gib = int(ram_text)
    if not 8 <= ram_gib <= 512:
        raise ValueError(f"--mac {name!r}: RAM {ram_gib} GB is outside 8-512 GB")
    return chip_id, ram_gib


def mac_profile(
    name: str, ssd_capacity_gb: int | None = None, wired_limit_mb: int | None = None
) -> MacProfile:
    """Profile for a named Mac, e.g. "m4-16gb"; published figures from data/macs.json.

    `ssd_capacity_gb` picks the SSD row (256 GB parts read slower); default: the chip's base size.
    `wired_limit_mb` models `sudo sysctl iogpu.wired_limit_mb=N`, which raises the GPU working set.
    """
    chip_id, ram_gib = parse_mac_name(name)
    table = _table()
    chip = table["chips"][chip_id]
    capacity_gb = ssd_capacity_gb if ssd_capacity_gb is not None else chip["default_ssd_gb"]["value"]
    if not isinstance(capacity_gb, int) or capacity_gb < 64:
        raise ValueError(f"--ssd-gb must be an int >= 64 (e.g. 256, 512, 1000), got {capacity_gb!r}")
    ssd = _ssd_entry(chip, capacity_gb)
    ram_bytes = ram_gib * GIB
    fraction, working_set_source = working_set_fraction(ram_gib)
    working_set_bytes = int(fraction * ram_bytes)
    if wired_limit_mb is not None:
        if not 1024 <= wired_limit_mb * MIB <= ram_bytes:
            raise ValueError(
                f"--wired-limit-mb {wired_limit_mb} must be between 1024 and the RAM size "
                f"({ram_bytes // MIB} MiB)"
            )
        working_set_bytes = wired_limit_mb * MIB
        working_set_source = f"iogpu.wired_limit_mb={wired_limit_mb} (user override)"
    sources = {
        "mem_bandwidth_gbps": chip["mem_bandwidth_gbps"]["source"],
        "gpu_tflops": chip["gpu_tflops"]["source"],
        "ssd_read_gbps": ssd["source"],
        "ssd_capacity_gb": "user (--ssd-gb)" if ssd_capacity_gb is not None
        else chip["default_ssd_gb"]["source"],
        "gpu_working_set_bytes": working_set_source,
        "page_cache_read_gbps": table["page_cache_read_gbps"]["source"],
        "os_reserved_bytes": table["os_reserved_fraction"]["source"],
    }
    return MacProfile(
        name=f"{chip_id}-{ram_gib}gb",
        label=f"{chip['label']}, {ram_gib} GB RAM, {capacity_gb} GB SSD",
        ram_bytes=ram_bytes,
        gpu_working_set_bytes=working_set_bytes,
        mem_bandwidth_gbps=float(chip["mem_bandwidth_gbps"]["value"]),
        gpu_tflops=float(chip["gpu_tflops"]["value"]),
        ssd_capacity_gb=capacity_gb,
        ssd_read_gbps=float(ssd["value"]),
        page_cache_read_gbps=float(table["page_cache_read_gbps"]["value"]),
        os_reserved_bytes=int(table["os_reserved_fraction"]["value"] * ram_bytes),
        sources=sources,
    )


def measured_profile(
    name: str,
    *,
    ram_bytes: int,
    mem_bandwidth_gbps: float,
    ssd_read_gbps: float,
    page_cache_read_gbps: float,
    gpu_tflops: float,
    gpu_working_set_bytes: int | None = None,
    os_reserved_bytes: int = 0,
    ssd_capacity_gb: int = 256,
) -> MacProfile:
    """Profile from numbers measured on the machine at hand (any OS), for predicted-vs-measured benches.

    The caller measures memory bandwidth, uncached and cached pread bandwidth and matmul
    throughput; without a Metal working set the whole RAM is the default working set.
    """
    return MacProfile(
        name=name,
        label=f"{name} (measured)",
        ram_bytes=ram_bytes,
        gpu_working_set_bytes=gpu_working_set_bytes if gpu_working_set_bytes is not None else ram_bytes,
        mem_bandwidth_gbps=mem_bandwidth_gbps,
        gpu_tflops=gpu_tflops,
        ssd_capacity_gb=ssd_capacity_gb,
        ssd_read_gbps=ssd_read_gbps,
        page_cache_read_gbps=page_cache_read_gbps,
        os_reserved_bytes=os_reserved_bytes,
        sources={key: "measured" for key in (
            "mem_bandwidth_gbps", "gpu_tflops", "ssd_read_gbps", "page_cache_read_gbps",
            "gpu_working_set_bytes",
        )},
    )
