"""Our safetensors header reader accepts real files and refuses malformed ones cleanly."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from storage import StoreError
from storage.safetensors_header import MAX_HEADER_BYTES, read_header


def _write(path, header: dict, data: bytes = b"", header_len: int | None = None):
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def test_reads_what_the_safetensors_library_writes(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.uint32)}
    save_file(arrays, str(tmp_path / "x.safetensors"), metadata={"format": "mlx"})
    h = read_header(tmp_path / "x.safetensors")
    assert h.metadata == {"format": "mlx"}
    raw = (tmp_path / "x.safetensors").read_bytes()
    for name, arr in arrays.items():
        e = h.entries[name]
        assert e.shape == arr.shape and e.nbytes == arr.nbytes
        assert raw[e.offset : e.offset + e.nbytes] == arr.tobytes()


@pytest.mark.parametrize(
    "header,data,match",
    [
        ({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype 'Q7'"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "beyond the file"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "reversed"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8, "is not \\[begin, end\\]"),
        (
            {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}},
            b"\0" * 12,
            "overlaps",
        ),
        ({"t": {"dtype": "F32", "shape": [[[[[[[[[[1]]]]]]]]]], "data_offsets": [0, 4]}}, b"\0" * 4, "nested deeper|shape"),
        ({"t": {"dtype": "U8", "shape": [2**62, 2**62], "data_offsets": [0, 1]}}, b"\0", "non-negative|needs"),
    ],
)
def test_malformed_entries_are_named_errors(tmp_path, header, data, match):
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(StoreError, match=match) as err:
        read_header(path)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_truncated_file(tmp_path):
    good = _write(tmp_path / "g.safetensors", {"t": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}, b"\1" * 64)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(StoreError, match="beyond the file"):
        read_header(cut)
    (tmp_path / "tiny.safetensors").write_bytes(b"\1\2\3")
    with pytest.raises(StoreError, match="8-byte header length"):
        read_header(tmp_path / "tiny.safetensors")


def test_header_length_beyond_file_or_bound(tmp_path):
    path = _write(tmp_path / "x.safetensors", {}, b"", header_len=10_000)
    with pytest.raises(StoreError, match="runs past the end"):
        read_header(path)
    path = _write(tmp_path / "y.safetensors", {}, b"", header_len=MAX_HEADER_BYTES + 1)
    with pytest.raises(StoreError, match="exceeds"):
        read_header(path)


def test_header_not_json(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(StoreError, match="not valid JSON"):
        read_header(p)
