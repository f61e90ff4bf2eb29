"""ExpertStore: where every expert's bytes live, for a raw checkpoint or a packed store.

A raw store is an mlx-lm checkpoint directory (config.json + model*.safetensors,
single or sharded with model.safetensors.index.json). Expert e of a layer is one
contiguous range in each stacked tensor: len(layout.tensors) ranges per expert.

A packed store is what `specmoe convert` writes (see storage.packed_format): the
resident weights in model.safetensors and one file per MoE layer in which each
expert is one contiguous, 16 KiB-aligned record with a CRC32.

Invariants: opening validates every header and every expert range against the
file sizes before anything is allocated for experts; ranges() of a key are in
layout order; read_into() fills the caller's views completely or raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from storage.checksum import crc32_of
from storage.errors import StoreError
from storage.file_pages import drop_pages
from storage.keys import ExpertKey
from storage.layout import LayerLayout, discover_layouts
from storage.packed_format import STORE_FILE, read_store_manifest
from storage.reader import RangeReader
from storage.safetensors_header import TensorEntry, read_header

MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ReadRange:
    path: str  # file to read
    offset: int  # absolute byte offset in the file
    nbytes: int  # bytes to read


def _load_json(path: Path, what: str, max_bytes: int = MAX_INDEX_BYTES) -> dict:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise StoreError(path, f"{what} is {size} bytes; expected at most {max_bytes}")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(path, f"{what} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise StoreError(path, f"{what} is not valid JSON ({type(e).__name__})") from None
    except OSError as e:
        raise StoreError(path, f"cannot read {what}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise StoreError(path, f"{what} is not a JSON object")
    return data


def _inside(root: Path, rel: str, where: Path) -> Path:
    """Resolve `rel` under `root`, refusing paths that escape it."""
    if not isinstance(rel, str) or not rel:
        raise StoreError(where, f"file name {rel!r} is not a non-empty string")
    p = (root / rel).resolve()
    if not p.is_relative_to(root.resolve()):
        raise StoreError(where, f"file name {rel!r} escapes the model directory")
    return p


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = _load_json(index, "weight index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise StoreError(index, "has no weight_map object")
        files = sorted({_inside(model_dir, f, index) for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise StoreError(f, "listed in model.safetensors.index.json but missing")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise StoreError(model_dir, "no model*.safetensors files; expected an mlx-lm checkpoint directory")
    return files


class ExpertStore:
    """Byte ranges of every routed expert, plus what is resident."""

    def __init__(self, model_dir: Path, kind: str, config: dict, layouts: dict[int, LayerLayout],
                 resident: dict[str, TensorEntry], ranges: dict[int, list[list[ReadRange]]],
                 checksums: dict[int, list[int]] | None, io_mode: str, resident_files: dict[str, str]):
        self.model_dir = model_dir  # directory mlx-lm can load the resident model from
        self.kind = kind  # "raw" or "packed"
        self.config = config  # config.json contents
        self._layouts = layouts
        self._resident = resident
        self._ranges = ranges
        self._checksums = checksums
        self._resident_files = resident_files
        self.reader = RangeReader(io_mode)

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, io_mode: str = "buffered") -> "ExpertStore":
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise StoreError(model_dir, "is not a directory; expected an mlx-lm checkpoint or a specmoe store")
        if (model_dir / STORE_FILE).exists():
            return cls._open_packed(model_dir, io_mode)
        return cls._open_raw(model_dir, io_mode)

    @classmethod
    def _open_raw(cls, model_dir: Path, io_mode: str) -> "ExpertStore":
        config = _load_json(model_dir / "config.json", "config.json")
        entries: dict[str, tuple[str, TensorEntry]] = {}
        for f in _weight_files(model_dir):
            header = read_header(f)
            for name, e in header.entries.items():
                if name in entries:
                    raise StoreError(f, f"tensor also stored in {entries[name][0]}", tensor=name)
                entries[name] = (str(f), e)
        layouts = discover_layouts(entries, config, model_dir)
        expert_names = {n for lay in layouts.values() for n in lay.tensor_names()}
        resident = {n: e for n, (_, e) in entries.items() if n not in expert_names}
        ranges: dict[int, list[list[ReadRange]]] = {}
        for layer, lay in layouts.items():
            per_tensor = [(entries[f"{lay.prefix}.{t.name}"], t) for t in lay.tensors]
            ranges[layer] = [
                [ReadRange(fpath, e.offset + x * t.nbytes, t.nbytes) for (fpath, e), t in per_tensor]
                for x in range(lay.n_experts)
            ]
        files = {n: entries[n][0] for n in resident}
        return cls(model_dir, "raw", config, layouts, resident, ranges, None, io_mode, files)

    @classmethod
    def _open_packed(cls, model_dir: Path, io_mode: str) -> "ExpertStore":
        manifest = read_store_manifest(model_dir)
        config = _load_json(model_dir / "config.json", "config.json")
        resident_header = read_header(_inside(model_dir, manifest.resident_file, model_dir / STORE_FILE))
        layouts, ranges, checksums = {}, {}, {}
        for lay, rel, records in manifest.layers:
            fpath = _inside(model_dir, rel, model_dir / STORE_FILE)
            header = read_header(fpath)
            end = header.file_bytes
            for x, (offset, _) in enumerate(records):
                if offset < header.data_start or offset + lay.expert_bytes > end:
                    raise StoreError(fpath, f"record of expert {x} at {offset} (+{lay.expert_bytes}) lies outside the file ({end} bytes)")
            layouts[lay.layer] = lay
            ranges[lay.layer] = [[ReadRange(str(fpath), off, lay.expert_bytes)] for off, _ in records]
            checksums[lay.layer] = [crc for _, crc in records]
        files = {n: str(resident_header.path) for n in resident_header.entries}
        return cls(model_dir, "packed", config, layouts, dict(resident_header.entries), ranges, checksums, io_mode, files)

    # -- queries ---------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        return list(self._layouts)

    def layout(self, layer: int) -> LayerLayout:
        try:
            return self._layouts[layer]
        except KeyError:
            raise ValueError(f"layer {layer} has no routed experts; MoE layers are {self.moe_layers}") from None

    def layouts(self) -> dict[int, LayerLayout]:
        return dict(self._layouts)

    def resident_tensors(self) -> dict[str, TensorEntry]:
        return dict(self._resident)

    def drop_resident_pages(self) -> int:
        """Evict the page-cache pages of every file a resident tensor lives in (storage/file_pages.py); bytes advised.

        Whole files: the kernel keeps a page folio a range covers only in part, and resident tensors share a
        raw shard with experts. Expert pages go too, which costs nothing when experts are read past the page
        cache (--io-mode direct, the only mode that calls this)."""
        return sum(drop_pages(f) for f in sorted(set(self._resident_files.values())))

    def resident_file(self, name: str) -> str:
        """The file holding resident tensor `name`."""
        return self._resident_files[name]

    @property
    def resident_bytes(self) -> int:
        return sum(e.nbytes for e in self._resident.values())

    @property
    def expert_bytes_total(self) -> int:
        return sum(lay.expert_bytes * lay.n_experts for lay in self._layouts.values())

    def ranges(self, key: ExpertKey) -> list[ReadRange]:
        lay = self.layout(key.layer)
        if not 0 <= key.expert < lay.n_experts:
            raise ValueError(f"expert {key.expert} out of range for layer {key.layer} ({lay.n_experts} experts)")
        return self._ranges[key.layer][key.expert]

    # -- reading ---------------------------------------------------------------------
    def reads(self, key: ExpertKey, views: list) -> list[tuple[str, int, list]]:
        """The positioned reads filling `views` (one writable uint8 buffer per layout tensor) with expert `key`:
        (path, offset, buffers) in layout order. A packed record is one read into every buffer."""
        rngs = self.ranges(key)
        if len(rngs) == 1:
            return [(rngs[0].path, rngs[0].offset, list(views))]
        return [(r.path, r.offset, [v]) for r, v in zip(rngs, views, strict=True)]

    def read_into(self, key: ExpertKey, views: list, reader: RangeReader | None = None) -> int:
        """Fill `views` (one writable uint8 buffer per layout tensor) with expert `key`, on this thread."""
        reader = reader or self.reader
        return sum(reader.read(path, offset, bufs) for path, offset, bufs in self.reads(key, views))

    def checksum(self, key: ExpertKey) -> int | None:
        """Stored CRC32 of a packed record (None for raw checkpoints)."""
        if self._checksums is None:
            return None
        self.ranges(key)
        return self._checksums[key.layer][key.expert]

    def verify(self, key: ExpertKey, views: list | None = None) -> bool:
        """True if the expert's bytes (read now, or the given views) match the stored CRC32."""
        expected = self.checksum(key)
        if expected is None:
            return True
        if views is None:
            import numpy as np

            views = [np.empty(t.nbytes, np.uint8) for t in self.layout(key.layer).tensors]
            self.read_into(key, views)
        return crc32_of(views) == expected

    def close(self) -> None:
        self.reader.close()
