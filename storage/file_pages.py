"""Dropping a file's clean pages from the page cache.

After the resident weights are loaded, the page cache still holds the file pages they were read from: a
second copy of every resident byte. A Linux memory cgroup charges that copy to the process (a Mac's
unified memory holds it too), so under a cap it counts against the expert cache's room until the kernel
reclaims it. With --io-mode direct the process keeps its reads off the page cache on purpose, so it also
drops these: `drop_pages(path)` asks the kernel to evict a file's pages (posix_fadvise POSIX_FADV_DONTNEED).
Benchmarks use the same call to start a run cold.

Invariants: advice only, never a read or a write; whole files (the kernel keeps a page folio that a range
covers only in part); clean pages go, dirty or mapped ones stay; where the call does not exist (macOS)
nothing happens and 0 bytes are reported.
"""

from __future__ import annotations

import os
from pathlib import Path


def drop_pages(path: str | Path) -> int:
    """Evict `path`'s pages from the page cache; returns the bytes advised (the file's size, 0 where unsupported)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
