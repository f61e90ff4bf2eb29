"""Our own safetensors header reader.

We parse headers ourselves because paging needs byte ranges of slices of
tensors; `mx.load` would read whole tensors.

Format: 8-byte little-endian header length N, N bytes of JSON mapping tensor
name -> {dtype, shape, data_offsets: [begin, end]} (offsets relative to the end
of the header), optionally "__metadata__" -> {str: str}.

Invariants of a returned SafetensorsHeader: every entry has a known dtype,
non-negative dimensions, nbytes == prod(shape) * itemsize, lies inside the file,
and no two entries overlap. The header is bounded (MAX_HEADER_BYTES) and is
checked against the file size before anything is allocated for it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from storage.errors import StoreError

MAX_HEADER_BYTES = 16 * 1024 * 1024  # real headers are KBs to a few MBs; parsed JSON is ~13x larger
MAX_JSON_DEPTH = 8
MAX_RANK = 8  # dimensions per tensor; a huge shape list is an allocation attack, not a tensor

DTYPE_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str  # tensor name as stored
    dtype: str  # safetensors dtype code, e.g. "U32", "BF16"
    shape: tuple[int, ...]  # full shape of the stored tensor
    offset: int  # absolute byte offset of the first byte in the file
    nbytes: int  # byte length of the tensor


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path  # the file the header was read from
    file_bytes: int  # size of the file when read
    data_start: int  # absolute offset of the data section (8 + header length)
    entries: dict[str, TensorEntry]  # name -> entry, every tensor in the file
    metadata: dict[str, str]  # the "__metadata__" block, {} if absent


def _json_depth(obj, depth: int = 0) -> int:
    if depth > MAX_JSON_DEPTH:
        return depth
    if isinstance(obj, dict):
        return max([depth] + [_json_depth(v, depth + 1) for v in obj.values()])
    if isinstance(obj, list):
        return max([depth] + [_json_depth(v, depth + 1) for v in obj])
    return depth


def _parse_entry(path: Path, name: str, raw, data_start: int, file_bytes: int) -> TensorEntry:
    if not isinstance(raw, dict):
        raise StoreError(path, "header entry is not an object", tensor=name)
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise StoreError(
            path, f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}", tensor=name
        )
    shape = raw.get("shape")
    if isinstance(shape, list) and len(shape) > MAX_RANK:
        raise StoreError(path, f"shape has {len(shape)} dimensions; expected at most {MAX_RANK}", tensor=name)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
    ):
        raise StoreError(path, f"shape {shape!r} is not a list of non-negative integers", tensor=name)
    offsets = raw.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise StoreError(path, f"data_offsets {offsets!r} is not [begin, end]", tensor=name)
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if begin < 0 or end < begin:
        raise StoreError(path, f"data_offsets {offsets} are negative or reversed", tensor=name)
    if end - begin != expected:
        raise StoreError(
            path,
            f"shape {shape} x {dtype} needs {expected} bytes but data_offsets {offsets} span {end - begin}",
            tensor=name,
        )
    if data_start + end > file_bytes:
        raise StoreError(
            path,
            f"data_offsets end {end} lies beyond the file (data section is {file_bytes - data_start} bytes; truncated?)",
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, expected)


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate the header of one safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            if file_bytes < 8:
                raise StoreError(path, f"file is {file_bytes} bytes; a safetensors file starts with an 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES:
                raise StoreError(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte bound")
            if 8 + header_len > file_bytes:
                raise StoreError(path, f"header length {header_len} runs past the end of the {file_bytes}-byte file")
            blob = f.read(header_len)
    except OSError as e:
        raise StoreError(path, f"cannot read: {e.strerror or e}") from e
    # Parsed JSON is far larger than its text (a list of a million zeros costs ~13x): refuse headers
    # whose lists are out of proportion to their tensors before parsing them.
    n_tensors = blob.count(b'"data_offsets"')
    n_items = blob.count(b",")
    if n_items > 32 * n_tensors + 1024:
        raise StoreError(path, f"header holds {n_items} list items (shape dimensions, offsets) for {n_tensors} tensors; "
                               "expected at most 32 per tensor")
    try:
        header = json.loads(blob.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # includes JSONDecodeError, bad UTF-8, json's integer-size cap
        raise StoreError(path, f"header is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise StoreError(path, "header is not a JSON object")
    if _json_depth(header) > 3:
        raise StoreError(path, "header JSON is nested deeper than a safetensors header can be")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise StoreError(path, "__metadata__ is not an object")
    entries = {
        name: _parse_entry(path, name, raw, data_start, file_bytes) for name, raw in header.items()
    }
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise StoreError(path, f"tensor overlaps {n0!r} (bytes {b1} < {e0})", tensor=n1)
    return SafetensorsHeader(path, file_bytes, data_start, entries, {str(k): str(v) for k, v in metadata.items()})
