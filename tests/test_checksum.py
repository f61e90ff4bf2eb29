"""Expert-record checksums (storage/checksum.py): the fast CRC-32 gives zlib's values over the views' bytes in
order, whatever the split, so stores packed before (with zlib) read now and the other way round; a corrupted
record is still refused (tests/test_faults.py covers the loader's retry and error)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from storage import checksum
from storage.checksum import crc32_of


@pytest.mark.parametrize("splits", [[], [0], [1], [7, 64], [4096, 4097, 50_000]])
def test_crc32_of_views_equals_zlib_over_their_concatenation(splits):
    data = np.random.default_rng(len(splits)).integers(0, 256, 108 * 1024, dtype=np.uint8)
    views = np.split(data, splits)
    assert crc32_of(views) == zlib.crc32(data.tobytes())
    assert crc32_of(views[1:], crc32_of(views[:1])) == zlib.crc32(data.tobytes())  # chained, as a running crc


def test_the_fast_implementation_is_installed():
    """zlib-ng is a dependency (pyproject.toml); zlib is only the fallback for a platform without its wheel."""
    pytest.importorskip("zlib_ng")
    assert checksum.IMPLEMENTATION == "zlib-ng"


def test_a_flipped_bit_changes_the_checksum():
    data = np.zeros(4096, np.uint8)
    before = crc32_of([data])
    data[2048] ^= 1
    assert crc32_of([data]) != before
