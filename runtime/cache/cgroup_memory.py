"""The memory limit of the Linux cgroup this process lives in, for the `auto` budget and memory limit.

A container, a systemd slice or a test harness can cap a process far below the machine's RAM, and a
cgroup's limit counts page cache: sizing the expert cache from RAM there gets the process killed
(exit 137). So `auto` takes the smaller of RAM and this limit.

Reading (no writes, no privileges): /proc/self/cgroup names the process's cgroup per hierarchy.
    v1  "N:memory:/path"  -> <root>/memory/<path>/memory.limit_in_bytes
    v2  "0::/path"        -> <root>/<path>/memory.max   (or <root>/unified/<path>/memory.max, hybrid mounts)
The effective limit is the smallest one from the process's cgroup up to the hierarchy's root (a parent's
limit caps its children). v1's "unlimited" (a page-rounded 2^63 - 1) and v2's "max" mean no limit.

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


def _min_limit(base: Path, cgroup_path: str, filename: str) -> int | None:
    limits = [v for rel in _ancestors(cgroup_path) if (v := _read_limit(base / rel / filename)) is not None]
    return min(limits) if limits else None


def cgroup_limit_bytes(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup",
                       platform: str | None = None) -> int | None:
    """The memory limit of the process's cgroup (v1 or v2) in bytes, or None (see the module docstring)."""
    if (platform or sys.platform) != "linux":
        return None
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if "memory" in controllers.split(","):
            limits.append(_min_limit(root / "memory", path, "memory.limit_in_bytes"))
        elif controllers == "":
            for base in (root, root / "unified"):
                limits.append(_min_limit(base, path, "memory.max"))
    found = [v for v in limits if v is not None]
    return min(found) if found else None


def system_memory_bytes(ram_bytes: int | None = None, limit_bytes: int | None = None) -> int:
    """What the process may use: RAM (psutil) capped by its cgroup's limit when there is one."""
    if ram_bytes is None:
        import psutil

        ram_bytes = int(psutil.virtual_memory().total)
    if limit_bytes is None:
        limit_bytes = cgroup_limit_bytes()
    return min(ram_bytes, limit_bytes) if limit_bytes else ram_bytes
