"""Slot lifecycle and memory-safety checks of the expert cache.

Each test fails on the code before the fix: asserts that vanish under `python -O`,
a failed prefetch freeing a slot a demand call pins, a failed submit leaving a slot
loading forever, an observer left installed after a failed verify, and a trimmed
target vocabulary losing probability mass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from runtime.cache.expert_cache import ExpertCache
from runtime.cache.slot_table import FREE, LOADING, VALID
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig
from storage.reader import RangeReader

ROOT = Path(__file__).resolve().parent.parent


def test_slot_table_checks_raise_under_python_O():
    """The checks guarding slot ids are real exceptions, not asserts stripped by -O."""
    code = """
from runtime.cache.slot_table import SlotTable
from storage import ExpertKey
t = SlotTable({0: 4}, {0: 2})
k = ExpertKey(0, 1)
t.reserve(k)
for bad in (lambda: t.reserve(k), lambda: t.commit(ExpertKey(0, 2)), lambda: t.unpin(0, [0]),
            lambda: t.set_usable(0, 9)):
    try:
        bad()
    except (RuntimeError, ValueError) as e:
        print("raised", type(e).__name__)
    else:
        print("passed silently")
assert (t.layers[0].pins == 0).all()  # a refused unpin changed nothing (stripped under -O anyway)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["raised RuntimeError"] * 3 + ["raised ValueError"], out.stdout


def test_a_missing_expert_never_becomes_slot_minus_one(packed_dirs):
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    loader = AsyncLoader(store, LoaderConfig(threads=1))
    layer = store.moe_layers[0]
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    try:
        slots, _ = cache.ensure(layer, np.array([1, 2]))
        cache.unpin(layer, slots)
        assert cache.slot_ids(layer, np.array([[1, 2]])).min() >= 0
        with pytest.raises(RuntimeError, match=r"non-resident experts \[7\]"):
            cache.slot_ids(layer, np.array([[1, 7]]))  # -1 would be an out-of-bounds uint32 gather index
        ls = cache.table.layers[layer]
        # The device lookup table never says -1 either: an absent expert's code is n_slots + expert,
        # flagged by the device pass and clamped into range before any gather.
        codes = np.array(cache.device_tables[layer])[[1, 2, 7]]
        assert codes[:2].tolist() == cache.slot_ids(layer, np.array([1, 2])).tolist() and codes[2] == 4 + 7
        assert (ls.pins == 0).all() and cache.table.state_of(ExpertKey(layer, 7)) == FREE
    finally:
        loader.close()


class _FailFirstReadOf(RangeReader):
    """Blocks every read until `gate` is set; the first read of `offset` raises EIO."""

    def __init__(self, offset: int):
        super().__init__()
        self.gate, self.offset, self.failed = threading.Event(), offset, 0

    def read(self, path, offset, buffers):
        self.gate.wait(10)
        if offset == self.offset and not self.failed:
            self.failed += 1
            raise OSError(5, "Input/output error")
        return super().read(path, offset, buffers)


def test_a_failed_prefetch_does_not_free_a_slot_a_demand_call_pins(packed_dirs):
    """The demand call waiting on a prefetch that fails gets the expert (re-read for it),
    not the prefetch's error and not a slot that was freed under its pin."""
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layer = store.moe_layers[0]
    key = ExpertKey(layer, 5)
    reader = _FailFirstReadOf(store.ranges(key)[0].offset)
    loader = AsyncLoader(store, LoaderConfig(threads=1, max_retries=0), reader=reader)
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    ls = cache.table.layers[layer]
    result = {}

    def demand():
        try:
            result["slots"], _ = cache.ensure(layer, np.array([5]))
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    try:
        cache.prefetch([key], round_id=1)
        slot = cache.table.slot_of(key)
        caller = threading.Thread(target=demand)
        caller.start()
        deadline = time.monotonic() + 10
        while ls.pins[slot] < 2 and time.monotonic() < deadline:  # protection + the demand call's pin
            time.sleep(0.005)
        assert ls.pins[slot] == 2 and ls.state[slot] == LOADING
        reader.gate.set()  # the prefetch read fails now, while the demand call pins its slot
        caller.join(10)
        assert "error" not in result, result.get("error")
        assert reader.failed == 1 and int(result["slots"][0]) == slot and ls.state[slot] == VALID
        views = [np.zeros(t.nbytes, np.uint8) for t in store.layout(layer).tensors]
        store.read_into(key, views)
        assert all((a == b).all() for a, b in zip(cache.slot_views(layer, slot), views))
        cache.unpin(layer, result["slots"])
        cache.unprotect()
        assert (ls.pins == 0).all()
    finally:
        reader.gate.set()
        loader.close()


def test_a_failed_submit_leaves_no_slot_loading(packed_dirs):
    store = ExpertStore.open(packed_dirs["qwen3_moe"])
    layer = store.moe_layers[0]
    loader = AsyncLoader(store, LoaderConfig(threads=1))
    cache = ExpertCache({layer: store.layout(layer)}, {layer: 4}, loader)
    loader.close()  # every submit raises from now on
    ls = cache.table.layers[layer]
    with pytest.raises(RuntimeError, match="closed"):
        cache.prefetch([ExpertKey(layer, 3)], round_id=1)
    assert (ls.state == FREE).all() and (ls.pins == 0).all()
    cache.unprotect()  # nothing was left protected: unprotecting unpins nothing
    with pytest.raises(RuntimeError, match="closed"):
        cache.ensure(layer, np.array([1, 2]))
    assert (ls.state == FREE).all() and (ls.pins == 0).all() and (ls.expert_to_slot == -1).all()


def test_verify_restores_the_observer_when_the_forward_raises(tiny_dirs):
    from mlx_lm import load

    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
    from runtime.decode.pairing import build_predictor, make_drafter
    from runtime.decode.speculative import SpecConfig, SpeculativeDecoder

    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%", threads=1))
    try:
        dmodel, dconfig = load(str(tiny_dirs["qwen3_moe"]), return_config=True)[::2]
        dec = SpeculativeDecoder(om, make_drafter(dmodel, "none"), build_predictor("none", om, dmodel, dconfig),
                                 SpecConfig(num_draft=2))

        def failing_forward(*a, **kw):
            raise OSError("disk gone")

        dec._forward = failing_forward
        with pytest.raises(OSError, match="disk gone"):
            dec._verify([1, 2, 3], [])
        assert all(m.observer is None for m in om.modules.values())
    finally:
        om.close()


def test_sampling_keeps_target_mass_beyond_a_shorter_drafter_vocabulary():
    """Target vocabulary 6, drafter vocabulary 4 (padded tables differ): emitted tokens
    follow the target's p over all 6 tokens, including the 2 the drafter cannot propose."""
    from runtime.decode.speculative import SpecConfig, SpeculativeDecoder

    rng = np.random.default_rng(1)
    K, draws = 2, 6000
    logits = mx.array(np.log(np.array([[0.1, 0.2, 0.1, 0.1, 0.2, 0.3]] * (K + 1))))
    q = rng.dirichlet(np.ones(4), size=K)
    me = SimpleNamespace(cfg=SpecConfig(temp=1.0), rng=np.random.default_rng(2))
    counts = np.zeros(6)
    for _ in range(draws):
        tokens = [int(rng.choice(4, p=q[i])) for i in range(K)]
        n, token = SpeculativeDecoder._accept(me, SimpleNamespace(tokens=tokens, q=q), logits)
        counts[tokens[0] if n > 0 else token] += 1
    expected = np.array([0.1, 0.2, 0.1, 0.1, 0.2, 0.3]) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 20.5, (chi2, counts)  # df = 5, p = 0.001; trimming p to 4 tokens scores in the thousands


def test_the_oracle_variant_starts_from_an_empty_cache(tiny_dirs):
    """At a budget holding every expert, a cold run reads each expert decode needs beyond the
    prompt's once, prefetched or on demand: the oracle must read as much as `none`. Before the
    fix its recording run left the cache warm and the measured run read nothing."""
    from mlx_lm import load

    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
    from runtime.decode.speculative_run import run_speculative
    from tests.conftest import PROMPT

    dmodel, dconfig = load(str(tiny_dirs["qwen3_moe"]), return_config=True)[::2]
    read = {}
    for predictor in ("none", "oracle"):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%", threads=1))
        try:
            ids = om.tokenizer.encode(PROMPT)
            _, stats, _ = run_speculative(om, None, ids, max_tokens=12, num_draft=3, predictor=predictor,
                                          cutoff=None, draft_model=dmodel, draft_config=dconfig,
                                          warm="off")  # cold: a full budget would otherwise be read before decoding
            read[predictor] = (stats.counters["bytes_read"], stats.counters["misses"] + stats.counters["prefetch_loaded"])
        finally:
            om.close()
    assert read["none"][0] > 0 and read["oracle"] == read["none"], read


def test_not_holding_marks_exactly_the_slots_holding_the_experts():
    """LayerSlots.not_holding (from expert_to_slot) equals "owner not among the experts" on every slot that
    holds an expert, through reserves, commits, aborts, evictions and a shrink (it replaced np.isin)."""
    from runtime.cache.slot_table import SlotTable

    rng = np.random.default_rng(5)
    table = SlotTable({0: 32}, {0: 8}, policy="dlfu")
    ls = table.layers[0]
    for step in range(3000):
        e = int(rng.integers(32))
        key = ExpertKey(0, e)
        if ls.expert_to_slot[e] < 0:
            if table.reserve(key) is not None:
                (table.commit if rng.integers(4) else table.abort)(key)
        if step == 1500:
            table.set_usable(0, 5)
        experts = rng.choice(32, size=int(rng.integers(1, 6)), replace=False)
        held = ls.state[: ls.usable] != FREE
        owners = ls.slot_to_expert[: ls.usable]
        np.testing.assert_array_equal(ls.not_holding(experts)[held], ~np.isin(owners, experts)[held])
