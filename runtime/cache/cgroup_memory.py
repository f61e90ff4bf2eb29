"""The memory limit of the Linux cgroup this process lives in, for the `auto` budget and memory limit.

A container, a systemd slice or a test harness can cap a process far below the machine's RAM, and a
cgroup's limit counts page cache: sizing the expert cache from RAM there gets the process killed
(exit 137). So `auto` takes the smaller of RAM and this limit.

Reading (no writes, no privileges): /proc/self/cgroup names the process's cgroup per hierarchy.
    v1  "N:memory:/path"  -> <root>/memory/<path>/memory.limit_in_bytes
    v2  "0::/path"        -> <root>/<path>/memory.max   (or <root>/unified/<path>/memory.max, hybrid mounts)
The effective limit is the smallest one from the process's cgroup up to the hierarchy's root (a parent's
limit caps its children). v1's "unlimited" (a page-rounded 2^63 - 1) and v2's "max" mean no limit.

`cgroup_available_bytes()` is the same hierarchy's headroom, for the memory governor: at each level with a
limit, limit - usage + file pages (active and inactive: page cache the kernel reclaims before it kills,
as the kernel's MemAvailable counts it); the smallest over the levels. v1 reads memory.usage_in_bytes
and memory.stat's total_active_file/total_inactive_file, v2 memory.current and memory.stat's
active_file/inactive_file. Inside an 8 GB cap on a 24 GB machine this is what is left of the 8 GB, not
the machine's free RAM.

Invariants: None when there is no limit, no cgroup file system, or not Linux (macOS keeps its rules);
an unreadable or malformed file counts as no limit at that level, never as an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

UNLIMITED_BYTES = 1 << 60  # v1 reports "no limit" as 9223372036854771712; anything this large is none


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < UNLIMITED_BYTES else None


def _ancestors(path: str) -> list[str]:
    """'/a/b' -> ['a/b', 'a', '']: the cgroup and each parent up to the hierarchy's root."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file"))
V2_FILES = ("memory.max", "memory.current", ("active_file", "inactive_file"))


def _memory_levels(proc_cgroup: str | Path, root: str | Path, platform: str | None) -> list[tuple[Path, tuple]]:
    """Every level of the process's memory cgroups, from its own up to each hierarchy's root, with that
    hierarchy's (limit, usage, file-page fields) names; [] off Linux or without a readable /proc/self/cgroup."""
    if (platform or sys.platform) != "linux":
        return []
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    root = Path(root)
    levels = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if "memory" in controllers.split(","):
            levels += [(root / "memory" / rel, V1_FILES) for rel in _ancestors(path)]
        elif controllers == "":
            levels += [(base / rel, V2_FILES) for base in (root, root / "unified") for rel in _ancestors(path)]
    return levels


def cgroup_limit_bytes(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup",
                       platform: str | None = None) -> int | None:
    """The memory limit of the process's cgroup (v1 or v2) in bytes, or None (see the module docstring)."""
    found = [v for level, (limit_file, _, _) in _memory_levels(proc_cgroup, root, platform)
             if (v := _read_limit(level / limit_file)) is not None]
    return min(found) if found else None


def _stat_fields(path: Path, names: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    fields = dict(line.split(" ", 1) for line in lines if " " in line)
    return sum(int(fields[n]) for n in names if fields.get(n, "").strip().isdigit())


def _level_available(level: Path, limit_file: str, usage_file: str, file_fields: tuple[str, ...]) -> int | None:
    limit = _read_limit(level / limit_file)
    if limit is None:
        return None
    try:
        usage = int((level / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return max(0, limit - usage + _stat_fields(level / "memory.stat", file_fields))


def cgroup_available_bytes(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup",
                           platform: str | None = None) -> int | None:
    """What is left under the process's cgroup limits (see the module docstring), or None without a limit."""
    found = [v for level, files in _memory_levels(proc_cgroup, root, platform)
             if (v := _level_available(level, *files)) is not None]
    return min(found) if found else None


def system_memory_bytes(ram_bytes: int | None = None, limit_bytes: int | None = None) -> int:
    """What the process may use: RAM (psutil) capped by its cgroup's limit when there is one."""
    if ram_bytes is None:
        import psutil

        ram_bytes = int(psutil.virtual_memory().total)
    if limit_bytes is None:
        limit_bytes = cgroup_limit_bytes()
    return min(ram_bytes, limit_bytes) if limit_bytes else ram_bytes
