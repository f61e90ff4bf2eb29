"""The packed store format written by `specmoe convert` (format version 1).

Directory layout:
    store.json                  manifest (this module); written last, so a directory
                                without it is not a store
    config.json, tokenizer*     copied from the source checkpoint
    model.safetensors           resident (non-expert) weights, loadable by mlx-lm
    experts/layer_NNN.safetensors
                                one file per MoE layer; valid safetensors whose tensors
                                are "e{E}.{proj}.{part}" plus "pad{E}" fillers, arranged so
                                expert E's tensors form one contiguous record starting at
                                a RECORD_ALIGN-aligned file offset

store.json fields: format ("specmoe-store"), version (1), model_type, source (the
path converted from), checksum ("crc32"), alignment, resident_file, layers: list of
{layout (LayerLayout.to_json()), file, records: [[absolute offset, crc32], ...]}.

Invariant: read_store_manifest() validates types, counts and bounds of every field
before anything is opened or allocated from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from storage.errors import StoreError
from storage.layout import LayerLayout
from storage.safetensors_header import DTYPE_ITEMSIZE

FORMAT_NAME = "specmoe-store"
FORMAT_VERSION = 1
STORE_FILE = "store.json"
RESIDENT_FILE = "model.safetensors"
RECORD_ALIGN = 16 * 1024
MAX_MANIFEST_BYTES = 32 * 1024 * 1024  # a 60-layer x 512-expert store needs about 1 MB
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12


@dataclass(frozen=True)
class StoreManifest:
    model_type: str  # config.json model_type at conversion time
    source: str  # the checkpoint directory converted from
    resident_file: str  # relative path of the resident weights
    layers: list[tuple[LayerLayout, str, list[tuple[int, int]]]]  # (layout, relative file, [(offset, crc32)])


def _int(v, what: str, where: Path, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise StoreError(where, f"{what} is {v!r}; expected an integer in [{lo}, {hi}]")
    return v


def _layout(d, where: Path) -> LayerLayout:
    if not isinstance(d, dict):
        raise StoreError(where, "layer layout is not an object")
    try:
        lay = LayerLayout.from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise StoreError(where, f"layer layout is malformed ({type(e).__name__}: {e})") from None
    _int(lay.layer, "layer", where, 0, MAX_LAYERS)
    _int(lay.n_experts, f"layer {lay.layer} n_experts", where, 1, MAX_EXPERTS)
    for t in lay.tensors:
        if not isinstance(t.dtype, str) or t.dtype not in DTYPE_ITEMSIZE:
            raise StoreError(where, f"layer {lay.layer} tensor {t.name} has unknown dtype {t.dtype!r}")
        n = DTYPE_ITEMSIZE[t.dtype]
        for s in t.shape:
            n *= _int(s, f"layer {lay.layer} {t.name} dimension", where, 0, 1 << 40)
        if n != t.nbytes:
            raise StoreError(where, f"layer {lay.layer} tensor {t.name}: shape {list(t.shape)} x {t.dtype} is {n} bytes, manifest says {t.nbytes}")
    return lay


def read_store_manifest(store_dir: Path) -> StoreManifest:
    where = store_dir / STORE_FILE
    try:
        size = where.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise StoreError(where, f"is {size} bytes; expected at most {MAX_MANIFEST_BYTES}")
        data = json.loads(where.read_text(encoding="utf-8"))
    except StoreError:
        raise
    except (ValueError, RecursionError) as e:  # includes JSONDecodeError, bad UTF-8, json's integer-size cap
        raise StoreError(where, f"is not valid JSON ({type(e).__name__})") from None
    except OSError as e:
        raise StoreError(where, f"cannot read: {e.strerror or e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise StoreError(where, f"is not a {FORMAT_NAME} manifest")
    if data.get("version") != FORMAT_VERSION:
        raise StoreError(where, f"format version {data.get('version')!r}; this specmoe reads version {FORMAT_VERSION}")
    if data.get("checksum") != "crc32":
        raise StoreError(where, f"checksum {data.get('checksum')!r}; expected 'crc32'")
    layers_raw = data.get("layers")
    if not isinstance(layers_raw, list) or not 0 < len(layers_raw) <= MAX_LAYERS:
        raise StoreError(where, "layers is not a non-empty list")
    layers = []
    for entry in layers_raw:
        if not isinstance(entry, dict):
            raise StoreError(where, "layer entry is not an object")
        lay = _layout(entry.get("layout"), where)
        records = entry.get("records")
        if not isinstance(records, list) or len(records) != lay.n_experts:
            raise StoreError(where, f"layer {lay.layer} has {len(records) if isinstance(records, list) else records!r} records; expected {lay.n_experts}")
        recs = []
        for r in records:
            if not isinstance(r, list) or len(r) != 2:
                raise StoreError(where, f"layer {lay.layer} record {r!r} is not [offset, crc32]")
            recs.append((_int(r[0], "record offset", where), _int(r[1], "record crc32", where, 0, 2**32 - 1)))
        spans = sorted(recs)
        for (a, _), (b, _) in zip(spans, spans[1:]):
            if b < a + lay.expert_bytes:
                raise StoreError(where, f"layer {lay.layer} records at {a} and {b} overlap")
        layers.append((lay, entry.get("file"), recs))
    resident = data.get("resident_file", RESIDENT_FILE)
    return StoreManifest(str(data.get("model_type", "")), str(data.get("source", "")), resident, layers)


def manifest_json(model_type: str, source: str, layers: list[dict]) -> str:
    return json.dumps(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": model_type,
            "source": source,
            "checksum": "crc32",
            "alignment": RECORD_ALIGN,
            "resident_file": RESIDENT_FILE,
            "layers": layers,
        },
        indent=1,
    )
