"""A decode token's MoE call (CachedSwitchGLU._token_call) runs in one lock round trip when its experts are all valid
(SlotTable.use_valid) and calls ensure() with its unique experts known when some are not; it must leave everything
as the general path (release_pending, wants_expert_major, ensure, slot_ids, telemetry.on_call) would: the same tokens
as stock mlx-lm, the same hits, misses, evictions and prefetch counts, the same expert -> slot tables (so the same
recency and victims), the same telemetry and host syncs.

The comparison run forces the general path by replacing the token call with a release and a sync. Planted defects
in the token call (no recency, an off-by-one slot on a hit or after a read, no pin) are shown to fail these checks.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import numpy as np
from mlx_lm import load as mlx_load

from runtime import load, stream_generate
from runtime.cache.cached_switch import CachedSwitchGLU
from runtime.cache.expert_cache import ExpertCache
from runtime.cache.slot_table import VALID, SlotTable
from tests.conftest import PROMPT, greedy_ids

N = 24


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    model, tok = mlx_load(str(tiny_dirs["qwen3_moe"]))
    ids = list(tok.encode(PROMPT))
    return ids, greedy_ids(model, ids, N)


def general_only(mp: pytest.MonkeyPatch) -> None:
    """Every call takes the general path: the token call only releases, syncs and hands the ids over."""
    def token_call(self, x, indices):
        self.release_pending()
        self.cache.unprotect(self.layer)
        self.cache.host_syncs += 1
        return None, np.array(indices)
    mp.setattr(CachedSwitchGLU, "_token_call", token_call)


def run(path, budget: str, ids: list[int], count: list | None = None) -> dict:
    engine = load(path, budget=budget)
    try:
        om = engine.model
        if count is not None:
            real = om.cache.use_valid

            def counted(layer, experts, release):
                got = real(layer, experts, release)
                count.append(got is not None)
                return got
            om.cache.use_valid = counted
        tokens = [r.token for r in stream_generate(engine, ids, N)]
        table = om.cache.table
        return {"tokens": tokens,
                "stats": {l: asdict(ls.stats) for l, ls in table.layers.items()},
                "slots": {l: ls.expert_to_slot.tolist() for l, ls in table.layers.items()},
                "pins": {l: int(ls.pins.sum()) for l, ls in table.layers.items()},
                "telemetry": {l: untimed(asdict(r)) for l, r in om.telemetry.totals.items()},
                "host_syncs": om.cache.host_syncs,
                "counters": untimed(om.counters())}
    finally:
        engine.close()


def untimed(fields: dict) -> dict:
    """Without the measured times (waits for reads differ from run to run)."""
    return {k: v for k, v in fields.items() if not k.endswith("_ms")}


def differences(a: dict, b: dict) -> list[str]:
    return [k for k in a if a[k] != b[k]]


@pytest.fixture(scope="module")
def general(tiny_dirs, reference):
    mp = pytest.MonkeyPatch()
    general_only(mp)
    try:
        return {b: run(tiny_dirs["qwen3_moe"], b, reference[0]) for b in ("50%", "25%")}
    finally:
        mp.undo()


@pytest.mark.parametrize("budget", ["50%", "25%"])
def test_token_call_books_as_the_general_path(tiny_dirs, reference, general, budget):
    count: list = []
    got = run(tiny_dirs["qwen3_moe"], budget, reference[0], count)
    assert got["tokens"] == reference[1] == general[budget]["tokens"]
    assert any(count), "decode calls took the token call"
    assert not all(count), "some decode calls missed and took the general path"
    assert got["stats"][min(got["stats"])]["misses"] > 0
    assert differences(got, general[budget]) == []
    assert set(got["pins"].values()) == {0}  # every pin released at the end of the generation


def no_recency(mp: pytest.MonkeyPatch) -> None:
    """The token call counts its hits but does not tell the eviction policy about the uses."""
    def use_valid(self, layer, experts):
        ls = self.layers[layer]
        slots = [int(ls.expert_to_slot[e]) for e in experts]
        if any(s < 0 or ls.state[s] != VALID for s in slots):
            return None
        ls.stats.hits += len(slots)
        self.pin(layer, slots)
        return slots, 0
    mp.setattr(SlotTable, "use_valid", use_valid)


def off_by_one(mp: pytest.MonkeyPatch) -> None:
    """The token call's slots are one past the expert's own (the last slot stays itself)."""
    real = SlotTable.use_valid

    def use_valid(self, layer, experts):
        got = real(self, layer, experts)
        if got is None:
            return None
        slots, used = got
        self.unpin(layer, slots)
        shifted = [min(s + 1, self.layers[layer].n_slots - 1) for s in slots]
        self.pin(layer, shifted)
        return shifted, used
    mp.setattr(SlotTable, "use_valid", use_valid)


def no_pin(mp: pytest.MonkeyPatch) -> None:
    """The token call does not pin its slots: a pending graph's slots could be evicted."""
    real = SlotTable.use_valid

    def use_valid(self, layer, experts):
        got = real(self, layer, experts)
        if got is not None:
            self.unpin(layer, got[0])
        return got
    mp.setattr(SlotTable, "use_valid", use_valid)


def read_off_by_one(mp: pytest.MonkeyPatch) -> None:
    """A call that read experts gets slots one past theirs (the last slot stays itself)."""
    real = ExpertCache.ensure

    def ensure(self, layer, experts):
        slots, stats = real(self, layer, experts)
        if not stats.misses:
            return slots, stats
        self.unpin(layer, slots)
        shifted = np.minimum(slots + 1, self.n_slots(layer) - 1)
        with self._lock:
            self.table.pin(layer, shifted)
        return shifted, stats
    mp.setattr(ExpertCache, "ensure", ensure)


@pytest.mark.parametrize("plant", [no_recency, off_by_one, no_pin, read_off_by_one], ids=lambda f: f.__name__)
def test_a_planted_defect_in_the_token_call_is_caught(tiny_dirs, reference, general, monkeypatch, plant):
    plant(monkeypatch)
    try:
        got = run(tiny_dirs["qwen3_moe"], "25%", reference[0])
    except RuntimeError as e:  # an unpin of a slot the token call never pinned
        assert "not pinned" in str(e)
        return
    assert got["tokens"] != reference[1] or differences(got, general["25%"])
