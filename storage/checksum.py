"""crc32 of an expert record: the packed store's checksum (storage/packed_format.py), computed where a record
is written (storage/packer.py) and checked where it is read (storage/loader.py, ExpertStore.verify).

A demand read is checked on the thread that waits for it, so the checksum is on the decode's critical path:
zlib's crc32 runs at ~3 GB/s here (~37 us for a 108 KB expert; ~0.6 ms for a 1.7 MB one), zlib-ng's (the same
CRC-32, SIMD-folded) at ~39 GB/s. zlib-ng is a dependency; zlib is the fallback where no wheel installs.

Invariants: crc32_of(views) equals zlib.crc32 over the views' bytes in order, whichever implementation runs,
so stores packed with either read with either.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32 as _crc32

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # no wheel for this platform: the same values, ~10x slower
    from zlib import crc32 as _crc32

    IMPLEMENTATION = "zlib"


def crc32_of(views, crc: int = 0) -> int:
    """CRC-32 of the buffers in `views` (anything exposing a C-contiguous buffer), as if concatenated."""
    for v in views:
        crc = _crc32(memoryview(v).cast("B"), crc)
    return crc
