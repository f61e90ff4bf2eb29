"""`specmoe convert`: pack a raw mlx-lm checkpoint into a specmoe store.

Each expert becomes one contiguous record (so one pread pages it in) aligned to
RECORD_ALIGN (so direct I/O needs no bounce copy of the head), with a CRC32.

Invariants:
- Atomic: everything is written into a hidden sibling directory, fsynced, and the
  manifest (store.json) is written last; only then is the directory renamed to DST.
  An interrupted convert leaves at most a hidden ".DST.partial-*" directory with no
  manifest, which ExpertStore.open() refuses and the next convert removes.
- The source is only read.
- Memory stays bounded by one expert record plus a copy chunk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from storage.checksum import crc32_of
from storage.errors import StoreError
from storage.keys import ExpertKey
from storage.packed_format import RECORD_ALIGN, RESIDENT_FILE, STORE_FILE, manifest_json
from storage.store import ExpertStore

COPY_CHUNK_BYTES = 8 * 1024 * 1024
_NOT_COPIED = {"model.safetensors.index.json", STORE_FILE}


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _header_bytes(tensors: list[tuple[str, str, list[int], int, int]], align: int, metadata: dict) -> bytes:
    """Serialise a safetensors header (name, dtype, shape, begin, end) padded so the data starts aligned."""
    header = {"__metadata__": metadata}
    for name, dtype, shape, begin, end in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    total = _round_up(8 + len(blob), align)
    return (total - 8).to_bytes(8, "little") + blob + b" " * (total - 8 - len(blob))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_resident(src: ExpertStore, path: Path) -> None:
    entries = sorted(src.resident_tensors().items())
    tensors, pos = [], 0
    for name, e in entries:
        tensors.append((name, e.dtype, list(e.shape), pos, pos + e.nbytes))
        pos += e.nbytes
    with open(path, "wb") as out:
        out.write(_header_bytes(tensors, 8, {"format": "mlx"}))
        for name, e in entries:
            with open(src.resident_file(name), "rb") as f:
                f.seek(e.offset)
                left = e.nbytes
                while left:
                    chunk = f.read(min(left, COPY_CHUNK_BYTES))
                    if not chunk:
                        raise StoreError(src.resident_file(name), "ended while copying", tensor=name)
                    out.write(chunk)
                    left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())


def _write_layer(src: ExpertStore, layer: int, path: Path, progress: Callable[[int], None]) -> dict:
    lay = src.layout(layer)
    record = lay.expert_bytes
    stride = _round_up(record, RECORD_ALIGN)
    tensors, pos = [], 0
    for x in range(lay.n_experts):
        for t in lay.tensors:
            tensors.append((f"e{x}.{t.name}", t.dtype, list(t.shape), pos, pos + t.nbytes))
            pos += t.nbytes
        if stride > record:
            tensors.append((f"pad{x}", "U8", [stride - record], pos, pos + stride - record))
            pos += stride - record
    header = _header_bytes(tensors, RECORD_ALIGN, {"format": "specmoe-experts", "prefix": lay.prefix})
    buf = np.zeros(stride, np.uint8)
    views, at = [], 0
    for t in lay.tensors:
        views.append(buf[at : at + t.nbytes])
        at += t.nbytes
    records = []
    with open(path, "wb") as out:
        out.write(header)
        for x in range(lay.n_experts):
            src.read_into(ExpertKey(layer, x), views)
            records.append([len(header) + x * stride, crc32_of([buf[:record]])])
            out.write(buf.tobytes())
            progress(record)
        out.flush()
        os.fsync(out.fileno())
    return {"layout": lay.to_json(), "file": str(path.relative_to(path.parent.parent)), "records": records}


def convert(src_dir: str | Path, dst_dir: str | Path, *, force: bool = False,
            progress: Callable[[int], None] | None = None, on_start: Callable[[int], None] | None = None) -> Path:
    """Pack `src_dir` into `dst_dir`. `on_start(total_bytes)` then `progress(bytes)` report progress."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    progress = progress or (lambda n: None)
    src = ExpertStore.open(src_dir)
    if src.kind != "raw":
        raise StoreError(src_dir, "is already a packed specmoe store; convert reads an mlx-lm checkpoint")
    if dst_dir.resolve() == src_dir.resolve() or dst_dir.resolve().is_relative_to(src_dir.resolve()):
        raise ValueError(f"destination {dst_dir} must be outside the source checkpoint {src_dir}")
    if dst_dir.exists() and not force:
        raise ValueError(f"destination {dst_dir} exists; pass --force to replace it")
    dst_dir.parent.mkdir(parents=True, exist_ok=True)
    # Leftovers of an interrupted convert: a partial new store, or the old store a --force was replacing.
    for stale in [*dst_dir.parent.glob(f".{dst_dir.name}.partial-*"), *dst_dir.parent.glob(f".{dst_dir.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dst_dir.parent / f".{dst_dir.name}.partial-{os.getpid()}"
    tmp.mkdir()
    try:
        if on_start:
            on_start(src.expert_bytes_total)
        for f in sorted(src_dir.iterdir()):
            # Projection files (`specmoe calibrate`) travel with the model: the drafter pairs with both.
            is_projection = f.name.startswith("specmoe-projection-") and f.name.endswith(".safetensors")
            if f.is_file() and (is_projection or not f.name.endswith(".safetensors")) and f.name not in _NOT_COPIED:
                shutil.copy2(f, tmp / f.name)
        _write_resident(src, tmp / RESIDENT_FILE)
        (tmp / "experts").mkdir()
        layers = [
            _write_layer(src, layer, tmp / "experts" / f"layer_{layer:03d}.safetensors", progress)
            for layer in src.moe_layers
        ]
        model_type = str(src.config.get("model_type", ""))
        manifest = tmp / STORE_FILE
        manifest.write_text(manifest_json(model_type, str(src_dir.resolve()), layers))
        with open(manifest, "rb") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp / "experts")
        _fsync_dir(tmp)
        if dst_dir.exists():
            trash = dst_dir.parent / f".{dst_dir.name}.old-{os.getpid()}"
            os.rename(dst_dir, trash)
            os.rename(tmp, dst_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, dst_dir)
        _fsync_dir(dst_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        src.close()
    return dst_dir
