"""Disk faults: injected EIO/EINTR/short/slow/bit flips never change a token.

Transient faults are retried (or re-read on a CRC mismatch) and the greedy tokens
equal a fault-free run; permanent faults stop the run with a StoreError naming
layer, expert, file and offset, after which no token is emitted and no slot of the
failed expert is valid. FAULT_CASES is also what bench/fault_table.py runs to
write the table in docs/reliability.md.
"""

from __future__ import annotations

import errno
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.cache.slot_table import VALID
from tests.conftest import expert_views as _views
from storage import ExpertKey, StoreError
from storage.faults import FaultSpec, FaultyReader, parse_faults
from storage.reader import RangeReader

N_TOKENS = 16
BUDGET = "25%"


# -- the end-to-end cases (shared with bench/fault_table.py) -----------------------------
@dataclass(frozen=True)
class FaultCase:
    name: str  # row label in the table
    spec: str  # --inject spec; "{mid}" becomes a read count in the middle of the decode
    store: str  # "packed" (CRC-checked records) or "raw" (the mlx-lm checkpoint: no checksums)
    expect: str  # "identical" tokens, a named "error", or "undetected" (documented limit)
    match: str = ""  # regex the error message must match
    speculative: bool = False  # speculative decoding with prefetch instead of plain greedy


FAULT_CASES = [
    FaultCase("EIO twice", "eio:after=5,times=2", "packed", "identical"),
    FaultCase("EIO 3x in a row (= max_retries)", "eio:after=5,times=3", "raw", "identical"),
    FaultCase("EINTR twice", "eintr:after=3,times=2", "packed", "identical"),
    FaultCase("short read twice (packed)", "short:after=8,times=2", "packed", "identical"),
    FaultCase("short read twice (raw, no CRC)", "short:after=8,times=2", "raw", "identical"),
    FaultCase("slow reads (2 ms, 30% of reads)", "slow:ms=2,p=0.3,seed=1", "packed", "identical"),
    FaultCase("bit flip once (CRC re-read)", "flip:after=10,times=1", "packed", "identical"),
    FaultCase("all of the above", "eio:after=5,times=2;eintr:after=12,times=1;short:after=20,times=2;"
              "slow:ms=1,p=0.2;flip:after=30,times=1", "packed", "identical"),
    FaultCase("all of the above, speculative + prefetch", "eio:after=5,times=2;eintr:after=12,times=1;"
              "short:after=20,times=2;slow:ms=1,p=0.2;flip:after=30,times=1", "packed", "identical", speculative=True),
    FaultCase("EIO forever (mid-decode)", "eio:after={mid}", "packed", "error",
              r"reading expert \d+ of layer \d+ at offset \d+ failed after 4 attempts"),
    FaultCase("EIO forever (raw)", "eio:after={mid}", "raw", "error",
              r"reading expert \d+ of layer \d+ at offset \d+ failed after 4 attempts"),
    FaultCase("bit flip forever (CRC)", "flip:after={mid}", "packed", "error",
              r"checksum mismatch for expert \d+ of layer \d+ at offset \d+"),
    FaultCase("short reads forever", "short:after={mid}", "raw", "error",
              r"reading expert \d+ of layer \d+ at offset \d+ failed after 4 attempts: short read"),
    FaultCase("EIO forever, speculative + prefetch", "eio:after={mid}", "packed", "error",
              r"reading expert \d+ of layer \d+ at offset \d+ failed", speculative=True),
    FaultCase("bit flip forever, raw checkpoint (no CRC: undetected)", "flip:after={mid},byte=3,bit=6", "raw", "undetected"),
]


def _load(path: Path, verify: bool = True):
    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel

    return OffloadedModel.load(path, OffloadConfig(budget=BUDGET, verify_checksums=verify, threads=2))


def _generate(om, ids: list[int], drafter, on_token) -> None:
    if drafter is None:
        from runtime.decode.plain import generate_tokens

        generate_tokens(om.model, ids, max_tokens=N_TOKENS, om=om, on_token=on_token)
    else:
        from runtime.decode.speculative_run import run_speculative

        run_speculative(om, None, ids, max_tokens=N_TOKENS, num_draft=3, predictor="previous", cutoff=None,
                        on_token=on_token, draft_model=drafter[0], draft_config=drafter[1])


_REFERENCES: dict[tuple, tuple[list[int], int]] = {}


def _reference(path: Path, prompt: str, drafter) -> tuple[list[int], int]:
    """Fault-free tokens and a read count halfway through the decode (memoized per run kind)."""
    memo = (str(path), prompt, drafter is not None)
    if memo not in _REFERENCES:
        om = _load(path)
        counter = FaultyReader(om.loader.reader, [])
        om.loader.reader = counter
        tokens, reads_at = [], []
        try:
            ids = om.tokenizer.encode(prompt)
            _generate(om, ids, drafter, lambda t: (tokens.append(t), reads_at.append(counter.n_reads)))
        finally:
            om.close()
        _REFERENCES[memo] = (tokens, (reads_at[0] + counter.n_reads) // 2)
    return _REFERENCES[memo]


def run_fault_case(case: FaultCase, paths: dict[str, Path], prompt: str, drafter=None) -> dict:
    """Run `case` and its fault-free reference; returns what happened (for asserts and the table)."""
    path = paths[case.store]
    drafter = drafter if case.speculative else None
    expected, mid = _reference(path, prompt, drafter)
    om = _load(path)
    reader = FaultyReader(om.loader.reader, parse_faults(case.spec.format(mid=mid)), om.store)
    om.loader.reader = reader
    tokens: list[int] = []
    error = None
    failed_key = None
    try:
        ids = om.tokenizer.encode(prompt)
        _generate(om, ids, drafter, tokens.append)
    except StoreError as e:
        error = e
        m = re.search(r"expert (\d+) of layer (\d+)", str(e))
        if m:
            failed_key = ExpertKey(int(m[2]), int(m[1]))
    try:
        return {
            "case": case, "tokens": tokens, "expected": expected, "error": error, "failed_key": failed_key,
            "failed_slot_valid": failed_key is not None and om.cache.table.state_of(failed_key) == VALID,
            "fired": dict(reader.counts), "fault_keys": {ev.key for ev in reader.events},
            "retries": om.loader.stats.n_retries, "n_failed": om.loader.stats.n_failed,
        }
    finally:
        om.close()


def check_outcome(out: dict) -> None:
    """The assertions every case must pass (the table only reports what these checked)."""
    case, tokens, expected, error = out["case"], out["tokens"], out["expected"], out["error"]
    kinds = {s.kind for s in parse_faults(case.spec.replace("{mid}", "0"))}
    assert set(out["fired"]) == kinds, f"{case.name}: faults that fired {out['fired']}, expected {kinds}"
    if case.expect == "identical":
        assert error is None, f"{case.name}: {error}"
        assert tokens == expected, f"{case.name}: tokens differ from the fault-free run"
        if kinds - {"slow"}:
            assert out["retries"] > 0 and out["n_failed"] == 0
    elif case.expect == "error":
        assert error is not None, f"{case.name}: the run did not stop"
        msg = str(error)
        assert re.search(case.match, msg), msg
        assert ".safetensors" in msg and "\n" not in msg  # names the file, one line
        assert out["failed_key"] in out["fault_keys"], "the error names a record that was not faulted"
        assert not out["failed_slot_valid"], "a failed load left a valid slot"
        assert len(tokens) < len(expected) and tokens == expected[: len(tokens)], "a token was emitted after the fault"
    else:
        assert error is None  # raw checkpoints carry no checksum: corruption cannot be seen


@pytest.fixture(scope="module")
def fault_paths(tiny_dirs, packed_dirs) -> dict[str, Path]:
    return {"raw": tiny_dirs["qwen3_moe"], "packed": packed_dirs["qwen3_moe"]}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    from mlx_lm import load

    from runtime.checkpoints.tiny import make_tiny
    from tests.conftest import TINY

    path = make_tiny(tmp_path_factory.mktemp("fault-drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


@pytest.mark.parametrize("case", FAULT_CASES, ids=[c.name for c in FAULT_CASES])
def test_fault_case(case, fault_paths, drafter):
    from tests.conftest import PROMPT

    check_outcome(run_fault_case(case, fault_paths, PROMPT, drafter))


# -- the spec parser ------------------------------------------------------------------------
def test_parse_faults():
    f = parse_faults("eio:layer=1,expert=3,times=2; slow:ms=5 ;flip:times=1,byte=7,bit=3;short:bytes=10;eintr")
    assert [x.kind for x in f] == ["eio", "slow", "flip", "short", "eintr"]
    assert (f[0].layer, f[0].expert, f[0].times) == (1, 3, 2)
    assert f[1].ms == 5.0 and f[1].times == float("inf")
    assert (f[2].byte, f[2].bit) == (7, 3) and f[3].nbytes == 10


@pytest.mark.parametrize("spec,match", [
    ("boom", "unknown fault 'boom'"),
    ("eio:layer", "is not key=value"),
    ("eio:colour=red", "unknown key 'colour'"),
    ("eio:layer=x", "layer='x' is not a number"),
    ("flip:bit=9", "bit=9"),
    ("eio:p=2", "p=2.0"),
    (" ; ", "no fault given"),
])
def test_parse_faults_refuses_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_faults(spec)


def test_cli_inject_is_hidden_and_errors_are_one_line(packed_dirs):
    from tests.conftest import run_cli

    code, out, _ = run_cli(["generate", "--help"])
    assert code == 0 and "--inject" not in out
    code, _, err = run_cli(["generate", "--model", str(packed_dirs["qwen3_moe"]), "--prompt", "hi", "-n", "4",
                            "--budget", "25%", "--no-memory-governor", "--inject", "eio"])
    line = err.strip().splitlines()[-1]
    assert code == 2 and re.search(r"specmoe: error: .*layer_\d+\.safetensors: reading expert \d+ of layer \d+ at offset \d+", line)


# -- the reader wrapper ----------------------------------------------------------------------


def _bytes(views) -> bytes:
    return b"".join(v.tobytes() for v in views)


def _clean(store, key) -> bytes:
    v = _views(store, key.layer)
    store.read_into(key, v)
    return _bytes(v)


def test_each_kind_misbehaves_as_specified(store):
    key = ExpertKey(store.moe_layers[1], 4)
    total = store.layout(key.layer).expert_bytes
    expected = _clean(store, key)

    def read(spec):
        v = _views(store, key.layer)
        n = store.read_into(key, v, FaultyReader(RangeReader(), spec, store))
        return n, _bytes(v)

    with pytest.raises(OSError) as err:
        read("eio")
    assert err.value.errno == errno.EIO
    with pytest.raises(InterruptedError):
        read("eintr")
    n, got = read("short:bytes=100")
    assert n == 100 and got[:100] == expected[:100] and set(got[100:]) == {0xA5}
    n, got = read("flip:byte=5,bit=2")
    diff = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert n == total and diff == [5] and got[5] ^ expected[5] == 4
    n, got = read("slow:ms=1")
    assert (n, got) == (total, expected)
    n, got = read("eio:layer=0")  # another layer: passed through
    assert (n, got) == (total, expected)


def test_times_after_and_matching(store):
    layer = store.moe_layers[0]
    reader = FaultyReader(RangeReader(), f"eio:layer={layer},expert=2,after=1,times=2", store)
    outcomes = []
    for e in [2, 3, 2, 2, 2, 2]:
        try:
            store.read_into(ExpertKey(layer, e), _views(store, layer), reader)
            outcomes.append("ok")
        except OSError:
            outcomes.append("eio")
    assert outcomes == ["ok", "ok", "eio", "eio", "ok", "ok"]
    assert reader.counts == {"eio": 2} and [ev.key for ev in reader.events] == [ExpertKey(layer, 2)] * 2


def test_fault_counts_are_exact_under_many_threads(store):
    layer = store.moe_layers[0]
    reader = FaultyReader(RangeReader(), "eio:times=25", store)
    failures = []

    def work():
        for e in range(32):
            try:
                store.read_into(ExpertKey(layer, e), _views(store, layer), reader)
            except OSError:
                failures.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(failures) == 25 and reader.n_reads == 8 * 32


def test_a_fault_fires_once_per_range_however_the_loader_cuts_it(store):
    """The loader reads a record in pieces; the reads continuing a range pass through, so an unfiltered `slow`
    delays one read per expert (as the benches that emulate a per-read latency assume) and the bytes are intact."""
    from storage import AsyncLoader, LoaderConfig

    layer = store.moe_layers[1]
    reader = FaultyReader(RangeReader(), "slow:ms=0", store)
    loader = AsyncLoader(store, LoaderConfig(threads=2, piece_bytes=1024), reader=reader)
    views = {e: _views(store, layer) for e in range(6)}
    tickets = [loader.submit(ExpertKey(layer, e), v) for e, v in views.items()]
    loader.wait_all(tickets)
    loader.close()
    assert all(len(t.pieces) > 1 for t in tickets)
    assert reader.counts == {"slow": 6} and reader.n_reads == 6
    assert all(_bytes(v) == _clean(store, ExpertKey(layer, e)) for e, v in views.items())


def test_range_reader_loops_over_partial_preadv(store, monkeypatch):
    """Kernels may return fewer bytes than asked (signals, network filesystems)."""
    import os

    import storage.reader as reader_module

    real = os.preadv
    calls = []

    def dribble(fd, buffers, offset):
        calls.append(offset)
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[: min(7, len(first))]], offset)

    key = ExpertKey(store.moe_layers[2], 6)
    expected = _clean(store, key)
    monkeypatch.setattr(reader_module.os, "preadv", dribble)
    v = _views(store, key.layer)
    assert store.read_into(key, v, RangeReader()) == len(expected)
    assert _bytes(v) == expected and len(calls) >= len(expected) // 7


def test_faultspec_validation():
    with pytest.raises(ValueError, match="expected one of"):
        FaultSpec("melt")
    assert FaultSpec("eio", layer=1).matches(ExpertKey(1, 9)) and not FaultSpec("eio", layer=1).matches(None)
