"""RangeReader: positioned reads of byte ranges straight into caller buffers.

Modes:
- "buffered": os.preadv into the destination buffers (through the page cache).
- "direct": bypass the page cache. Linux: O_DIRECT, which needs block-aligned
  offsets, lengths and addresses, so we read the aligned cover of the range into
  an aligned bounce buffer and copy out. macOS: F_NOCACHE on the descriptor,
  which needs no alignment. Elsewhere direct falls back to buffered.

Invariants: read() either fills every destination byte or raises OSError; it
never returns a short count. File descriptors are opened lazily and shared;
preadv/pread are positioned so threads may share a descriptor.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading

IO_MODES = ("buffered", "direct")
_DIRECT_ALIGN = 4096


class RangeReader:
    """Reads (path, offset) ranges into lists of writable buffers."""

    def __init__(self, io_mode: str = "buffered"):
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode={io_mode!r}; expected one of {IO_MODES}")
        self.io_mode = io_mode
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._direct = io_mode == "direct" and hasattr(os, "O_DIRECT")

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                flags = os.O_RDONLY
                if self._direct:
                    flags |= os.O_DIRECT
                try:
                    fd = os.open(path, flags)
                except OSError:
                    if not self._direct:
                        raise
                    # Some filesystems (tmpfs, overlay) refuse O_DIRECT: read buffered.
                    fd = os.open(path, os.O_RDONLY)
                    self._direct = False
                if self.io_mode == "direct" and sys.platform == "darwin":
                    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
                self._fds[path] = fd
        return fd

    def read(self, path: str, offset: int, buffers: list) -> int:
        """Fill `buffers` (uint8 numpy arrays or memoryviews) from `path` at `offset`."""
        fd = self._fd(path)
        if self._direct:
            return self._read_direct(fd, offset, buffers)
        return self._read_buffered(fd, offset, buffers)

    @staticmethod
    def _read_buffered(fd: int, offset: int, buffers: list) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        done = 0
        while views:
            n = os.preadv(fd, views, offset + done)
            if n == 0:
                raise OSError(5, f"unexpected end of file at offset {offset + done}")
            done += n
            # Advance past fully read buffers; keep the rest of a partly read one.
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        return total

    def _bounce(self, nbytes: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            size = (nbytes + _DIRECT_ALIGN - 1) // _DIRECT_ALIGN * _DIRECT_ALIGN
            buf = mmap.mmap(-1, size)  # anonymous mappings are page-aligned
            self._local.buf = buf
        return buf

    def _read_direct(self, fd: int, offset: int, buffers: list) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        start = offset // _DIRECT_ALIGN * _DIRECT_ALIGN
        end = (offset + total + _DIRECT_ALIGN - 1) // _DIRECT_ALIGN * _DIRECT_ALIGN
        bounce = self._bounce(end - start)
        window = memoryview(bounce)[: end - start]
        got = 0
        while got < end - start:
            n = os.preadv(fd, [window[got:]], start + got)
            if n == 0:
                break  # end of file inside the aligned cover is fine
            got += n
        if got < offset - start + total:
            raise OSError(5, f"unexpected end of file at offset {start + got}")
        pos = offset - start
        for v in views:
            v[:] = window[pos : pos + len(v)]
            pos += len(v)
        return total

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
