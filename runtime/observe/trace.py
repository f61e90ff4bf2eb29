"""Routing traces: which experts every token used in every MoE layer, saved compactly.

File format, version 1 (extension .smtrace). The whole file is one zstd frame
whose decompressed bytes are:
    8 bytes   magic b"SPMOETRC"
    4 bytes   format version, little-endian uint32 (1)
    4 bytes   header length H, little-endian uint32 (at most 16 MiB)
    H bytes   UTF-8 JSON header:
                model: {name, model_type, digest, n_experts, top_k, moe_layers}
                sequences: [token count of each sequence]
                dtype: "uint16"
    rest      expert ids, uint16 little-endian, C order, shape (sum(sequences), len(moe_layers), top_k)

Invariants: load() checks magic, version, header bounds and that the payload has
exactly the bytes the header promises before building arrays; a trace is only
analysed against the model it was recorded on (digest check) when one is given.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

MAGIC = b"SPMOETRC"
VERSION = 1
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TRACE_BYTES = 4 * 1024**3


@dataclass
class RoutingTrace:
    model: dict  # name, model_type, digest, n_experts, top_k, moe_layers
    sequences: list[np.ndarray]  # each (tokens, layers, k) expert ids

    @property
    def n_experts(self) -> int:
        return int(self.model["n_experts"])

    @property
    def top_k(self) -> int:
        return int(self.model["top_k"])

    @property
    def moe_layers(self) -> list[int]:
        return list(self.model["moe_layers"])

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def layer(self, i: int) -> list[np.ndarray]:
        """The sequences of the i-th MoE layer, each (tokens, k)."""
        return [s[:, i, :] for s in self.sequences]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        header = json.dumps({"model": self.model, "sequences": [len(s) for s in self.sequences], "dtype": "uint16"}).encode()
        payload = b"".join(np.ascontiguousarray(s, dtype="<u2").tobytes() for s in self.sequences)
        raw = MAGIC + struct.pack("<II", VERSION, len(header)) + header + payload
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(zstandard.ZstdCompressor(level=10).compress(raw))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, expect_digest: str | None = None) -> "RoutingTrace":
        path = Path(path)
        try:
            blob = path.read_bytes()
            raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_TRACE_BYTES)
        except FileNotFoundError:
            raise ValueError(f"{path}: trace file not found") from None
        except zstandard.ZstdError as e:
            raise ValueError(f"{path}: not a zstd-compressed specmoe trace ({e})") from None
        if raw[:8] != MAGIC or len(raw) < 16:
            raise ValueError(f"{path}: not a specmoe routing trace (bad magic)")
        version, hlen = struct.unpack("<II", raw[8:16])
        if version != VERSION:
            raise ValueError(f"{path}: trace format version {version}; this specmoe reads version {VERSION}")
        if hlen > MAX_HEADER_BYTES or 16 + hlen > len(raw):
            raise ValueError(f"{path}: trace header length {hlen} is out of bounds")
        try:
            header = json.loads(raw[16 : 16 + hlen])
            model, lengths = header["model"], header["sequences"]
            n_layers, k = len(model["moe_layers"]), int(model["top_k"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: trace header is malformed ({type(e).__name__}: {e})") from None
        if not all(isinstance(n, int) and n >= 0 for n in lengths):
            raise ValueError(f"{path}: trace sequence lengths must be non-negative integers")
        expected = sum(lengths) * n_layers * k * 2
        payload = raw[16 + hlen :]
        if len(payload) != expected:
            raise ValueError(f"{path}: trace payload is {len(payload)} bytes; the header promises {expected}")
        if expect_digest is not None and model.get("digest") != expect_digest:
            raise ValueError(
                f"{path}: trace was recorded on {model.get('name')} ({model.get('model_type')}, digest {model.get('digest')}), "
                f"not on this model (digest {expect_digest})"
            )
        ids = np.frombuffer(payload, dtype="<u2").reshape(-1, n_layers, k) if expected else np.zeros((0, n_layers, k), np.uint16)
        if ids.size and int(ids.max()) >= int(model["n_experts"]):
            raise ValueError(f"{path}: trace has expert id {int(ids.max())} but the model has {model['n_experts']} experts")
        bounds = np.cumsum([0] + lengths)
        return cls(model, [ids[a:b] for a, b in zip(bounds, bounds[1:])])
