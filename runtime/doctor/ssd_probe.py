"""Cold SSD reads: expert-sized reads of a freshly written file with the OS cache bypassed, at queue
depth 1 and 4.

The file is written with random bytes and fsynced, then read at random record offsets. Caching is
off: O_DIRECT on Linux (block-aligned buffers, sizes and offsets); F_NOCACHE on macOS, set on the
WRITING descriptor as well, because F_NOCACHE does not evict pages already cached and a file just
written is otherwise read back from RAM (the mistake [GW] documents). Where neither works, the pages
are dropped with posix_fadvise and the result is labelled "buffered (pages dropped)".

Invariants: the probe file lives in a temporary directory under `directory` and is removed however
the probe ends; each queue depth reads every record once, in a fresh random order.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["cold_read_gbps", "EXPERT_RECORD_BYTES"]

# Qwen3.5/3.6-35B-A3B's expert at mlx 4-bit (1,769,472 B = 432 x 4096: already block-aligned).
EXPERT_RECORD_BYTES = 1_769_472
_F_NOCACHE = 48  # <sys/fcntl.h> on macOS


def _nocache(fd: int) -> bool:
    if sys.platform != "darwin":
        return False
    import fcntl

    try:
        fcntl.fcntl(fd, _F_NOCACHE, 1)
        return True
    except OSError:
        return False


def _open_uncached(path: Path) -> tuple[int, str]:
    if sys.platform.startswith("linux") and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if _nocache(fd):
        return fd, "F_NOCACHE"
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, "buffered (pages dropped)"


def _write(path: Path, n_records: int, record: int) -> None:
    rng = np.random.default_rng(0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _nocache(fd)  # macOS: do not leave the written pages cached
        for _ in range(n_records):
            os.write(fd, rng.integers(0, 256, record, dtype=np.uint8).tobytes())
        os.fsync(fd)
    finally:
        os.close(fd)


def cold_read_gbps(directory: Path, file_bytes: int = 256 << 20, record_bytes: int = EXPERT_RECORD_BYTES,
                   depths: tuple[int, ...] = (1, 4)) -> dict:
    """GB/s and ms per read of cold expert-sized reads at each queue depth, and how caching was avoided."""
    record = -(-record_bytes // 4096) * 4096
    n_records = max(8, file_bytes // record)
    results: dict = {"record_bytes": record, "file_bytes": n_records * record, "depths": {}}
    with tempfile.TemporaryDirectory(prefix="specmoe-doctor-", dir=directory) as tmp:
        for depth in depths:
            path = Path(tmp) / f"cold-{depth}.bin"  # a fresh file per depth: nothing read before
            _write(path, n_records, record)
            fd, mode = _open_uncached(path)
            results["cache_bypass"] = mode
            order = np.random.default_rng(depth).permutation(n_records)
            buffers = [mmap.mmap(-1, record) for _ in range(depth)]  # page-aligned, as O_DIRECT needs

            def read(worker: int) -> None:
                for i in order[worker::depth]:
                    os.preadv(fd, [buffers[worker]], int(i) * record)

            try:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(depth) as pool:
                    list(pool.map(read, range(depth)))
                seconds = time.perf_counter() - t0
            finally:
                os.close(fd)
                path.unlink()
            results["depths"][str(depth)] = {
                "gbps": round(n_records * record / seconds / 1e9, 3),
                "ms_per_read": round(seconds * 1000 * depth / n_records, 3),
            }
        results["hot_gbps"] = _hot_read_gbps(Path(tmp) / "hot.bin", min(n_records, 32), record)
    return results


def _hot_read_gbps(path: Path, n_records: int, record: int) -> float:
    """Buffered reads of records already in the page cache (read once first), one at a time."""
    _write(path, n_records, record)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(record)
        for i in range(n_records):  # populate the page cache
            os.preadv(fd, [buffer], i * record)
        t0 = time.perf_counter()
        for i in np.random.default_rng(7).permutation(n_records):
            os.preadv(fd, [buffer], int(i) * record)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return round(n_records * record / seconds / 1e9, 3)
