"""Dropping a file's clean pages from the page cache once their bytes live elsewhere.

After the resident weights are loaded, the page cache still holds the file pages they were read from: a
second copy of every resident byte. A Linux memory cgroup charges that copy to the process (a Mac's
unified memory holds it too), so under a cap it counts against the expert cache's room until the kernel
reclaims it. With --io-mode direct the process keeps its reads off the page cache on purpose, so it also
drops these: `drop_pages(path, ranges)` asks the kernel to evict them (posix_fadvise POSIX_FADV_DONTNEED).

Invariants: advice only, never a read or a write; clean pages go, dirty or mapped ones stay, and so does a
page folio a range covers only in part (so callers advise whole files where they can); where the call
does not exist (macOS) nothing happens and 0 bytes are reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def drop_pages(path: str | Path, ranges: Iterable[tuple[int, int]] | None = None) -> int:
    """Evict `path`'s pages in `ranges` ((offset, nbytes) pairs; None: the whole file); returns bytes advised."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if ranges is None:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return os.fstat(fd).st_size
        total = 0
        for offset, nbytes in ranges:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            total += nbytes
        return total
    finally:
        os.close(fd)
