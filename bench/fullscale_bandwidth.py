"""Cold read bandwidth of a checkpoint's disk: O_DIRECT reads at random aligned offsets of its shards.

O_DIRECT bypasses the page cache, so the number is the disk's, whatever was read before. The pattern is
the expert loader's: `chunk_bytes` reads (an expert's tensor slice is 0.1-3 MB) at random offsets, from
`threads` threads at once (the loader's default is 4). The limit a capped run is judged against uses
this figure: bytes a token must read / bandwidth.

Invariants: reads only, never past a file's end; every buffer and offset is 4096-aligned (O_DIRECT's rule).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN = 4096


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # bytes read / wall time
    n_reads: int  # reads issued
    chunk_bytes: int  # bytes per read
    threads: int  # concurrent readers
    seconds: float  # wall time

    def line(self) -> str:
        return (f"O_DIRECT {self.n_reads} x {self.chunk_bytes / 1e6:.2f} MB random reads, {self.threads} threads: "
                f"{self.bytes_per_s / 1e9:.2f} GB/s")


def read_bandwidth(paths: list[Path], *, total_bytes: int = 1 << 30, chunk_bytes: int = 1 << 20, threads: int = 4,
                   seed: int = 0) -> Bandwidth:
    """Read about `total_bytes` in `chunk_bytes` pieces from random aligned offsets of `paths`."""
    chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
    sizes = [os.path.getsize(p) for p in paths]
    usable = [(p, s) for p, s in zip(paths, sizes) if s >= chunk]
    if not usable:
        raise ValueError(f"no file of {[str(p) for p in paths]} holds one {chunk}-byte read")
    n = max(threads, total_bytes // chunk)
    rng = np.random.default_rng(seed)
    weights = np.array([s for _, s in usable], dtype=np.float64)
    which = rng.choice(len(usable), size=n, p=weights / weights.sum())
    jobs = [(usable[i][0], int(rng.integers(0, (usable[i][1] - chunk) // ALIGN + 1)) * ALIGN) for i in which]
    errors: list[BaseException] = []

    def worker(part):
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        fds: dict = {}
        try:
            for path, offset in part:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                if os.preadv(fd, [buf], offset) != chunk:
                    raise OSError(f"{path}: short read at {offset}")
        except BaseException as e:
            errors.append(e)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    parts = [jobs[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return Bandwidth(n * chunk / seconds, n, chunk, threads, seconds)


def checkpoint_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))
