"""Routing trace files: round trip, other models, hostile files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard

from runtime.observe.trace import MAGIC, RoutingTrace

MODEL = {"name": "m", "model_type": "qwen3_moe", "digest": "abc", "n_experts": 64, "top_k": 4, "moe_layers": [0, 1, 2]}


def _trace():
    rng = np.random.default_rng(0)
    return RoutingTrace(MODEL, [rng.integers(0, 64, (n, 3, 4)).astype(np.uint16) for n in (5, 0, 17)])


def test_round_trip(tmp_path):
    t = _trace()
    t.save(tmp_path / "x.smtrace")
    back = RoutingTrace.load(tmp_path / "x.smtrace", expect_digest="abc")
    assert back.model == MODEL and [len(s) for s in back.sequences] == [5, 0, 17]
    assert all((a == b).all() for a, b in zip(t.sequences, back.sequences))
    assert back.n_tokens == 22 and back.layer(1)[2].shape == (17, 4)


def test_trace_of_another_model_is_refused(tmp_path):
    _trace().save(tmp_path / "x.smtrace")
    with pytest.raises(ValueError, match="recorded on m .*not on this model"):
        RoutingTrace.load(tmp_path / "x.smtrace", expect_digest="zzz")


def _raw(tmp_path, raw: bytes):
    p = tmp_path / "bad.smtrace"
    p.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return p


@pytest.mark.parametrize("raw,match", [
    (b"NOTATRACE" + b"\0" * 20, "bad magic"),
    (MAGIC + struct.pack("<II", 9, 2) + b"{}", "version 9"),
    (MAGIC + struct.pack("<II", 1, 10**9) + b"{}", "header length"),
    (MAGIC + struct.pack("<II", 1, 5) + b"{oops", "malformed"),
])
def test_hostile_files(tmp_path, raw, match):
    with pytest.raises(ValueError, match=match):
        RoutingTrace.load(_raw(tmp_path, raw))


def test_payload_size_and_ids_are_checked(tmp_path):
    import json

    header = json.dumps({"model": MODEL, "sequences": [2], "dtype": "uint16"}).encode()
    short = MAGIC + struct.pack("<II", 1, len(header)) + header + b"\0" * 10
    with pytest.raises(ValueError, match="promises 48"):
        RoutingTrace.load(_raw(tmp_path, short))
    big = MAGIC + struct.pack("<II", 1, len(header)) + header + np.full(24, 999, "<u2").tobytes()
    with pytest.raises(ValueError, match="expert id 999"):
        RoutingTrace.load(_raw(tmp_path, big))
    (tmp_path / "plain").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a zstd"):
        RoutingTrace.load(tmp_path / "plain")
