"""Store fingerprints: every rank must page from an identical copy of the model.

A rank reads experts and its resident weights from its own local store, so two
Macs with different copies (another quantization, a half-finished copy, another
model) would compute garbage silently. At start every rank hashes its store and the
ranks compare: config.json, every resident tensor's name/dtype/shape and a sample of
its bytes (first and last 64), every MoE layer's expert layout, the packed store's
per-record CRC32s, and a 64-byte sample of expert 0 of every layer. That costs a few
hundred small reads, not a pass over the whole store.

Invariant: stores that differ in any of those fields have different fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os

from storage import ExpertKey, ExpertStore

SAMPLE_BYTES = 64


def _sample(path: str, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        head = os.pread(f.fileno(), min(SAMPLE_BYTES, nbytes), offset)
        tail = os.pread(f.fileno(), min(SAMPLE_BYTES, nbytes), offset + max(0, nbytes - SAMPLE_BYTES))
    return head + tail


def store_fingerprint(store: ExpertStore) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(store.config, sort_keys=True).encode())
    for name, e in sorted(store.resident_tensors().items()):
        h.update(f"{name}|{e.dtype}|{e.shape}|{e.nbytes}".encode())
        h.update(_sample(store.resident_file(name), e.offset, e.nbytes))
    for layer in store.moe_layers:
        h.update(json.dumps(store.layout(layer).to_json(), sort_keys=True).encode())
        key = ExpertKey(layer, 0)
        crcs = [store.checksum(ExpertKey(layer, x)) for x in range(store.layout(layer).n_experts)]
        h.update(repr(crcs).encode())
        for r in store.ranges(key):
            h.update(_sample(r.path, r.offset, r.nbytes))
    return h.hexdigest()[:16]


def check_same_stores(fingerprints: list[str], paths: list[str]) -> None:
    """Raise naming every rank whose store differs from rank 0's."""
    bad = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
    if bad:
        lines = "; ".join(f"rank {r}: {paths[r]} ({fingerprints[r]})" for r in bad)
        raise ValueError(f"the ranks' stores differ from rank 0's {paths[0]} ({fingerprints[0]}): {lines}; "
                         f"every rank needs an identical copy of the model (same checkpoint or `specmoe convert` output)")
