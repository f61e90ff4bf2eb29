"""Hostile input: malformed safetensors headers, store.json manifests and weight indexes.

Every case must end in a clean error (StoreError, or a ValueError naming the
problem), allocate little (tracemalloc peak far below what the file claims), and
return quickly. INPUT_CASES are hand-written attacks (also tabulated by
bench/fault_table.py); the hypothesis tests below throw random structure at the
same parsers with a bounded number of examples.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import StoreError
from storage.safetensors_header import DTYPE_ITEMSIZE, read_header
from storage.store import ExpertStore

PEAK_BOUND_BYTES = 4 << 20  # "no large allocation": a few MB, whatever the file claims
TIME_BOUND_S = 5.0


def _st_file(path: Path, header, data: bytes = b"", header_len: int | None = None, raw: bytes | None = None) -> Path:
    blob = raw if raw is not None else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def _t(dtype="U8", shape=(8,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _edit_manifest(d: Path, edit) -> Path:
    m = json.loads((d / "store.json").read_text())
    edit(m)
    (d / "store.json").write_text(json.dumps(m))
    return d


def _edit_index(d: Path, weight_map) -> Path:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def _sparse(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.truncate(nbytes)  # a hole: claims the size, costs no disk


@dataclass(frozen=True)
class InputCase:
    name: str  # row label
    target: str  # "header" (one file) or "packed" / "raw" (a copy of a tiny store/checkpoint)
    build: Callable[[Path], Path]  # writes the bad input under a work dir; returns what to open
    match: str  # regex the error must match
    known_bug: str = ""  # non-empty: a defect outside this change, tested as a strict xfail


INPUT_CASES = [
    # -- safetensors headers ---------------------------------------------------------------
    InputCase("header length beyond the file", "header", lambda d: _st_file(d / "x", {}, header_len=10_000), "runs past the end"),
    InputCase("header length claims 1 TiB", "header", lambda d: _st_file(d / "x", {}, header_len=1 << 40), "exceeds the"),
    InputCase("header length 2^64-1", "header", lambda d: _st_file(d / "x", {}, header_len=2**64 - 1), "exceeds the"),
    InputCase("file shorter than the length field", "header", lambda d: (d / "x").write_bytes(b"\1\2\3") and d / "x", "8-byte header length"),
    InputCase("tensor claims 4 GiB, file has 16 bytes", "header",
              lambda d: _st_file(d / "x", {"t": _t("F32", [1 << 30], [0, 4 << 30])}, b"\0" * 16), "beyond the file"),
    InputCase("overlapping tensors", "header",
              lambda d: _st_file(d / "x", {"a": _t(), "b": _t(offsets=(4, 12))}, b"\0" * 12), "overlaps"),
    InputCase("offsets reversed", "header", lambda d: _st_file(d / "x", {"t": _t(offsets=(8, 0))}, b"\0" * 8), "reversed"),
    InputCase("negative offset", "header", lambda d: _st_file(d / "x", {"t": _t(offsets=(-8, 0))}, b"\0" * 8), "negative"),
    InputCase("negative dimension", "header", lambda d: _st_file(d / "x", {"t": _t(shape=[-8])}, b"\0" * 8), "non-negative"),
    InputCase("shape 2^62 x 2^62 (overflows int64)", "header",
              lambda d: _st_file(d / "x", {"t": _t(shape=[2**62, 2**62], offsets=(0, 1))}, b"\0"), "non-negative|needs"),
    InputCase("dtype/shape/byte count disagree", "header",
              lambda d: _st_file(d / "x", {"t": _t("F32", [3], [0, 8])}, b"\0" * 8), "needs 12 bytes"),
    InputCase("unknown dtype", "header", lambda d: _st_file(d / "x", {"t": _t("Q7")}, b"\0" * 8), "unknown dtype"),
    InputCase("dtype is a list", "header", lambda d: _st_file(d / "x", {"t": _t(dtype=[])}, b"\0" * 8), "unknown dtype"),
    InputCase("boolean dimension", "header", lambda d: _st_file(d / "x", {"t": _t(shape=[True])}, b"\0"), "non-negative integers"),
    InputCase("JSON nested 100 000 deep", "header", lambda d: _st_file(d / "x", None, raw=b"[" * 100_000), "not valid JSON"),
    InputCase("valid JSON nested 12 deep", "header",
              lambda d: _st_file(d / "x", {"t": {"dtype": "U8", "shape": json.loads("[" * 12 + "]" * 12)}}), "nested deeper|shape"),
    InputCase("header not UTF-8", "header", lambda d: _st_file(d / "x", None, raw=b'{"\xff\xfe": 1}'), "not valid JSON"),
    InputCase("header is a JSON list", "header", lambda d: _st_file(d / "x", [1, 2]), "not a JSON object"),
    InputCase("__metadata__ not an object", "header", lambda d: _st_file(d / "x", {"__metadata__": 5}), "__metadata__"),
    InputCase("5000-digit integer", "header",
              lambda d: _st_file(d / "x", None, raw=b'{"t": {"dtype": "U8", "shape": [' + b"1" * 5000 + b'], "data_offsets": [0, 1]}}'),
              r"\[t\]|Exceeds the limit"),
    InputCase("1 MB header: one shape of 500 000 zeros", "header",
              lambda d: _st_file(d / "x", None, raw=b'{"t": {"dtype": "U8", "shape": [' + b"0," * 499_999 + b'0], "data_offsets": [0, 0]}}'),
              "rank|dimensions"),
    # -- weight index of a raw checkpoint ----------------------------------------------------
    InputCase("index path escapes the directory", "raw", lambda d: _edit_index(d, {"x": "../../etc/passwd"}), "escapes the model directory"),
    InputCase("index absolute path", "raw", lambda d: _edit_index(d, {"x": "/etc/passwd"}), "escapes the model directory"),
    InputCase("index path is a number", "raw", lambda d: _edit_index(d, {"x": 7}), "not a non-empty string"),
    InputCase("index names a missing shard", "raw", lambda d: _edit_index(d, {"x": "model-2.safetensors"}), "missing"),
    InputCase("index 100 MB (sparse file)", "raw",
              lambda d: _sparse(d / "model.safetensors.index.json", 100 << 20) or d, "expected at most"),
    InputCase("config.json not JSON", "raw", lambda d: (d / "config.json").write_text("{oops") and d, "not valid JSON"),
    # -- store.json of a packed store ---------------------------------------------------------
    InputCase("layer file escapes the store", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0].update(file="../../etc/passwd")), "escapes the model directory"),
    InputCase("resident file is absolute", "packed",
              lambda d: _edit_manifest(d, lambda m: m.update(resident_file="/etc/passwd")), "escapes the model directory"),
    InputCase("record beyond the layer file", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["records"][-1].__setitem__(0, 1 << 40)), "outside the file"),
    InputCase("overlapping records", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["records"][1].__setitem__(0, m["layers"][0]["records"][0][0] + 1)), "overlap"),
    InputCase("negative record offset", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["records"][0].__setitem__(0, -4096)), "record offset"),
    InputCase("CRC beyond 32 bits", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["records"][0].__setitem__(1, 1 << 40)), "crc32"),
    InputCase("records fewer than experts", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["records"].pop()), "records; expected"),
    InputCase("n_experts 10^6", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["layout"].update(n_experts=10**6)), "n_experts"),
    InputCase("tensor shape disagrees with its bytes", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["layout"]["tensors"][0].update(nbytes=3)), "manifest says"),
    InputCase("Infinity in a tensor shape", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["layout"]["tensors"][0]["shape"].__setitem__(0, float("inf"))),
              "malformed|dimension"),
    InputCase("tensor dtype is a list", "packed",
              lambda d: _edit_manifest(d, lambda m: m["layers"][0]["layout"]["tensors"][0].update(dtype=[])), "unknown dtype"),
    InputCase("unknown format version", "packed", lambda d: _edit_manifest(d, lambda m: m.update(version=99)), "format version"),
    InputCase("store.json nested 100 000 deep", "packed",
              lambda d: (d / "store.json").write_text("[" * 100_000) and d, "not valid JSON"),
    InputCase("store.json 300 MB (sparse file)", "packed", lambda d: _sparse(d / "store.json", 300 << 20) or d, "expected at most"),
    InputCase("layer file truncated", "packed",
              lambda d: os.truncate(d / "experts" / "layer_000.safetensors", 40_000) or d, "beyond the file|outside the file"),
]


def run_input_case(case: InputCase, work: Path, sources: dict[str, Path]) -> dict:
    """Build the bad input under `work`, open it, and report what happened."""
    if case.target == "header":
        work.mkdir(parents=True, exist_ok=True)
        target = case.build(work)
        opener = read_header
    else:
        shutil.copytree(sources[case.target], work)
        target = case.build(work)
        opener = ExpertStore.open
    tracemalloc.start()
    t0 = time.perf_counter()
    error = None
    try:
        opened = opener(target)
        if hasattr(opened, "close"):
            opened.close()
    except Exception as e:  # reported, then judged by check_input_outcome
        error = e
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"case": case, "error": error, "seconds": seconds, "peak_bytes": peak}


def check_input_outcome(out: dict) -> None:
    import re

    case, error = out["case"], out["error"]
    assert error is not None, f"{case.name}: accepted"
    assert isinstance(error, StoreError), f"{case.name}: {type(error).__name__}: {error}"
    assert re.search(case.match, str(error)), str(error)
    assert "\n" not in str(error)
    assert out["peak_bytes"] < PEAK_BOUND_BYTES, f"{case.name}: peak allocation {out['peak_bytes']} bytes"
    assert out["seconds"] < TIME_BOUND_S


@pytest.fixture(scope="module")
def sources(tiny_dirs, packed_dirs) -> dict[str, Path]:
    return {"raw": tiny_dirs["qwen3_moe"], "packed": packed_dirs["qwen3_moe"]}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=c.known_bug)) if c.known_bug else c for c in INPUT_CASES
], ids=[c.name for c in INPUT_CASES])
def test_hostile_input(case, sources, tmp_path):
    check_input_outcome(run_input_case(case, tmp_path / "work", sources))


# -- hypothesis ---------------------------------------------------------------------------------
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BIG = st.integers(min_value=-(2**64), max_value=2**64)
INTS = st.one_of(st.integers(-3, 64), BIG, st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.none())
entries = st.dictionaries(
    st.text(max_size=6),
    st.one_of(
        st.fixed_dictionaries({
            "dtype": st.one_of(st.sampled_from(sorted(DTYPE_ITEMSIZE)), st.text(max_size=4), st.none(),
                               st.lists(st.integers(), max_size=1), st.dictionaries(st.text(max_size=1), st.none(), max_size=1)),
            "shape": st.one_of(st.lists(INTS, max_size=4), INTS),
            "data_offsets": st.one_of(st.lists(INTS, max_size=3), INTS),
        }),
        INTS,
    ),
    max_size=5,
)


def _check_header(h, file_bytes: int) -> None:
    spans = []
    for e in h.entries.values():
        n = DTYPE_ITEMSIZE[e.dtype]
        for dim in e.shape:
            n *= dim
        assert e.nbytes == n and h.data_start <= e.offset and e.offset + e.nbytes <= file_bytes
        if e.nbytes:
            spans.append((e.offset, e.offset + e.nbytes))
    spans.sort()
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))


@FUZZ
@given(header=entries, data_len=st.integers(0, 256), claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_header_structure(header, data_len, claimed):
    with tempfile.TemporaryDirectory() as d:
        path = _st_file(Path(d) / "f.safetensors", header, b"\0" * data_len, header_len=claimed)
        tracemalloc.start()
        try:
            h = read_header(path)
        except StoreError:
            h = None
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < PEAK_BOUND_BYTES
        if h is not None:
            _check_header(h, path.stat().st_size)


@FUZZ
@given(blob=st.binary(max_size=512), claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_header_bytes(blob, claimed):
    with tempfile.TemporaryDirectory() as d:
        path = _st_file(Path(d) / "f.safetensors", None, header_len=claimed, raw=blob)
        try:
            read_header(path)
        except StoreError:
            pass


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), BIG, st.integers(-2, 70_000), st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from(["../x", "/etc/passwd", "experts", ".", "", "experts/layer_000.safetensors", "U8", "F32"]),
              st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    """Every path (tuple of keys / indices) into a JSON tree."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def scratch_store(packed_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "store"
    shutil.copytree(packed_dirs["qwen3_moe"], d)
    return d, json.loads((d / "store.json").read_text())


def _check_store(store: ExpertStore) -> None:
    root = store.model_dir.resolve()
    for layer in store.moe_layers:
        lay = store.layout(layer)
        for e in range(lay.n_experts):
            from storage import ExpertKey

            for r in store.ranges(ExpertKey(layer, e)):
                assert Path(r.path).resolve().is_relative_to(root)
                assert 0 <= r.offset and r.offset + r.nbytes <= Path(r.path).stat().st_size


@FUZZ
@given(data=st.data())
def test_fuzz_store_manifest(scratch_store, data):
    d, manifest = scratch_store
    m = json.loads(json.dumps(manifest))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(m))
        path = data.draw(st.sampled_from(paths[1:]))
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = data.draw(JSON)
    (d / "store.json").write_text(json.dumps(m))
    try:
        store = ExpertStore.open(d)
    except (StoreError, ValueError):  # ValueError: e.g. json's cap on 4300-digit integers
        return
    try:
        _check_store(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def scratch_raw(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-raw") / "ckpt"
    shutil.copytree(tiny_dirs["qwen3_moe"], d)
    return d


@FUZZ
@given(weight_map=st.one_of(JSON, st.dictionaries(st.text(max_size=8), JSON, max_size=4)))
def test_fuzz_weight_index(scratch_raw, weight_map):
    (scratch_raw / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    try:
        store = ExpertStore.open(scratch_raw)
    except (StoreError, ValueError):
        return
    try:
        _check_store(store)
    finally:
        store.close()
