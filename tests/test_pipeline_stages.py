"""Pipeline stages in one process: the split, the chain of stages against stock mlx-lm, rewinds, memory.

The multi-process runs (mlx.launch) are in test_pipeline_launch.py; these check the same stage code
without sockets, so they are fast.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_load

from runtime.pipeline import Stage, StageConfig, balanced_split, explicit_split, store_fingerprint
from runtime.plan import check_ranks, layer_of
from storage import ExpertStore
from tests.conftest import greedy_ids


def test_balanced_split_is_contiguous_covering_and_optimal():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n = int(rng.integers(2, 8))
        weights = [int(w) for w in rng.integers(1, 20, size=n)]
        extra = int(rng.integers(0, 30))
        for ranks in range(1, n + 1):
            split = balanced_split(weights, ranks, extra)
            assert split.ranges[0][0] == 0 and split.ranges[-1][1] == n
            assert all(a < b for a, b in split.ranges)
            assert all(split.ranges[i][1] == split.ranges[i + 1][0] for i in range(ranks - 1))
            # exhaustive: no contiguous split has a lighter heaviest rank
            best = min(
                max(sum(weights[a:b]) + (extra if r == 0 else 0) for r, (a, b) in enumerate(zip((0,) + cuts, cuts + (n,))))
                for cuts in itertools.combinations(range(1, n), ranks - 1)
            )
            assert max(split.weights) == best


def test_rank0_carries_the_head_so_it_gets_fewer_layers():
    split = balanced_split([10] * 8, 2, rank0_extra=20)
    assert split.ranges == ((0, 3), (3, 8))


def test_more_ranks_than_layers_and_bad_explicit_splits_are_refused():
    with pytest.raises(ValueError, match="3 pipeline ranks but the model has 2 decoder layers"):
        check_ranks(3, 2)
    with pytest.raises(ValueError, match="3 pipeline ranks but the model has 2"):
        balanced_split([1, 1], 3)
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        explicit_split([1, 2], [1, 1, 1, 1])


def _chain_greedy(stages, prompt_ids, n):
    """Greedy decode through stages chained in one process, as the ranks do over send/recv."""
    def run(tokens, kind="step"):
        h = stages[0].embed_tokens(tokens)
        for s in stages:
            h = s.run(h, kind=kind)
        return stages[0].logits(h)

    if len(prompt_ids) > 1:
        mx.eval(run(prompt_ids[:-1], "prefill"))
    y, out = prompt_ids[-1], []
    for _ in range(n):
        y = int(mx.argmax(run([y])[0, -1]).item())
        out.append(y)
    return out


@pytest.mark.parametrize("family,n_ranks,one_sync", [("qwen3_moe", 3, True), ("qwen3_5_moe", 2, True),
                                                     ("qwen3_moe", 3, False)])
def test_chained_stages_equal_stock_mlx_lm(tiny_dirs, packed_dirs, family, n_ranks, one_sync):
    """Each stage as one device pass (repairs at a 25% budget) or on the synced path: stock tokens either way."""
    model, tok = mlx_load(str(tiny_dirs[family]))
    ids = list(tok.encode("The quick brown fox jumps over the lazy dog."))
    want = greedy_ids(model, ids, 8)
    stages = [Stage.load(packed_dirs[family], r, n_ranks, StageConfig(budget="25%", one_sync=one_sync))
              for r in range(n_ranks)]
    try:
        assert [s.layer_ids for s in stages] == [list(range(a, b)) for a, b in stages[0].split.ranges]
        assert _chain_greedy(stages, ids, 8) == want
    finally:
        for s in stages:
            s.close()


@contextmanager
def _two_stages(path, **cfg):
    """Both ranks of a 2-stage split in this process, closed after."""
    stages = [Stage.load(path, r, 2, StageConfig(**cfg)) for r in range(2)]
    try:
        yield stages
    finally:
        for s in stages:
            s.close()


def test_a_stage_syncs_once_per_decode_step_with_its_experts_resident(packed_dirs):
    """Per rank: a decode step is one host sync (the device pass) once its experts are resident; the
    synced path makes one per MoE layer plus the output's. Repairs while experts are absent add syncs."""
    path = packed_dirs["qwen3_moe"]
    ids = [5, 9, 14, 3, 7, 21, 30, 11]
    per_step = {}
    for one_sync in (True, False):
        with _two_stages(path, budget="100%", one_sync=one_sync) as stages:
            first = _chain_greedy(stages, ids, 6)  # cold: experts read on demand (repairs)
            for s in stages:
                s.reset(0)
                s.syncs.clear()
            assert _chain_greedy(stages, ids, 6) == first  # warm: every expert of these steps resident
            per_step[one_sync] = [s.syncs["step"][1] / s.syncs["step"][0] for s in stages]
            if one_sync:
                assert all(s.device_pass.stats.repairs > 0 for s in stages)  # the cold run repaired
            moe = [len(s.modules) for s in stages]
    assert per_step[True] == [1.0, 1.0]
    assert per_step[False] == [m + 1.0 for m in moe]


def test_a_stage_routes_the_layers_that_keep_missing_and_stays_lossless(packed_dirs):
    """At 50% a stage's one-token forwards route the layers whose misses make a sync pay, by the rule of one
    process's verify windows (runtime/decode/window_routes.py): misses there are read before the experts run, not repaired; the tokens equal
    the synced path's."""
    path = packed_dirs["qwen3_moe"]
    ids = [5, 9, 14, 3, 7, 21, 30, 11]
    out = {}
    for one_sync in (True, False):
        with _two_stages(path, budget="50%", one_sync=one_sync) as stages:
            out[one_sync] = _chain_greedy(stages, ids, 16)
            if one_sync:
                passes = [s.device_pass for s in stages if s.device_pass is not None]
                assert passes and any(p.stats.routed > 0 for p in passes)
                assert all(p.stats.route_syncs >= p.stats.routed for p in passes)
    assert out[True] == out[False]


def test_rewind_by_rerun_restores_untrimmable_state(packed_dirs):
    """qwen3_5_moe's GatedDeltaNet state cannot be trimmed: rewind restores the snapshot and re-runs the kept prefix."""
    path = packed_dirs["qwen3_5_moe"]
    a = Stage.load(path, 0, 1, StageConfig(budget="100%"))
    b = Stage.load(path, 0, 1, StageConfig(budget="100%"))
    try:
        prompt, window, nxt = [5, 9, 14, 3], [7, 21, 30, 11], [2]
        for s in (a, b):
            mx.eval(s.forward(s.embed_tokens(prompt)))
        mx.eval(a.forward(a.embed_tokens(window), keep=True))  # verify window of 4; keep 2, reject 2
        assert a.rewind(rejected=2, keep_tokens=2) == 2
        mx.eval(b.forward(b.embed_tokens(window[:2])))  # a run that never saw the rejected tokens
        la, lb = a.logits(a.forward(a.embed_tokens(nxt))), b.logits(b.forward(b.embed_tokens(nxt)))
        assert mx.allclose(la, lb, atol=1e-4).item()
        assert int(mx.argmax(la[0, -1]).item()) == int(mx.argmax(lb[0, -1]).item())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_each_weight_lives_on_exactly_one_rank(packed_dirs, n_ranks):
    path = packed_dirs["qwen3_moe"]
    store = ExpertStore.open(path)
    resident = {n: e.nbytes for n, e in store.resident_tensors().items()}
    store.close()
    stages = [Stage.load(path, r, n_ranks, StageConfig(budget="50%")) for r in range(n_ranks)]
    try:
        held = [s.resident_bytes for s in stages]
        assert sum(held) == sum(resident.values())  # every non-expert weight evaluated once, on its owner
        for s in stages:
            own = sum(b for n, b in resident.items()
                      if (layer_of(n) in s.layer_ids) or (layer_of(n) is None and s.rank == 0))
            assert s.resident_bytes == own  # exactly its layers (rank 0: + embedding, norm, head)
            assert s.cache.nbytes == s.plan.budget_bytes  # its cache is its own budget...
            assert set(s.cache.layers()) == set(s.layer_ids)  # ...over its own layers only
    finally:
        for s in stages:
            s.close()


def test_fingerprint_tells_stores_apart(packed_dirs, tiny_dirs, tiny_qwen):
    fps = {k: store_fingerprint(ExpertStore.open(p)) for k, p in
           {"packed": packed_dirs["qwen3_moe"], "raw": tiny_dirs["qwen3_moe"], "other": tiny_qwen}.items()}
    again = store_fingerprint(ExpertStore.open(packed_dirs["qwen3_moe"]))
    assert fps["packed"] == again
    assert len(set(fps.values())) == 3  # a packed copy, the raw checkpoint, another seed


def test_pipeline_outside_mlx_launch_is_a_one_line_error():
    from tests.conftest import run_cli

    code, out, err = run_cli(["generate", "-m", "runtime/data/tiny/target", "-p", "hi", "--pipeline"])
    assert code == 2 and out == ""
    assert "--pipeline: this process is not part of an mlx.launch group" in err and "mlx.launch -n N" in err


class _OneRank:
    """The channel of a pipeline of one rank: the driver runs its stage locally and sends nothing."""

    rank, size = 0, 1
    stats = SimpleNamespace(bytes_sent=0)  # what rank_report() reads of a channel


@pytest.mark.parametrize("adaptive", [True, False])
def test_pipeline_speculative_adapts_k_as_one_process_and_equals_plain(packed_dirs, tmp_path, adaptive):
    """An untrained drafter is rarely accepted: adaptive K (runtime.decode.DraftLength, as single-process
    speculative decoding) falls back to plain rounds (K=0) with probes; a fixed K (SpecConfig) keeps K. Same greedy tokens."""
    from runtime.checkpoints.tiny import make_tiny
    from runtime.decode import SpecConfig, load_drafter, make_drafter
    from runtime.pipeline import PipelineDriver, PipelineSpeculative, generate_plain, pipeline_predictor

    path = packed_dirs["qwen3_moe"]
    stage = Stage.load(path, 0, 1, StageConfig(budget="50%"))
    try:
        draft_model, draft_config = load_drafter(make_tiny(tmp_path / "drafter", "qwen3", seed=7, layers=2), stage)
        ids, n = [5, 9, 14, 3, 7, 21, 30, 11], 24
        plain, _ = generate_plain(PipelineDriver(stage, _OneRank()), ids, max_tokens=n)
        stage.reset(0)
        drafter = make_drafter(draft_model, "none")
        predictor = pipeline_predictor("none", stage, draft_model, draft_config)
        spec = PipelineSpeculative(PipelineDriver(stage, _OneRank()), drafter, predictor,
                                   SpecConfig(num_draft=3, adaptive_k=adaptive))
        tokens, stats = spec.generate(ids, n)
        assert tokens == plain
        if adaptive:
            assert stats.n_plain_rounds > 0 and stats.n_drafted < 3 * stats.n_rounds
        else:
            assert stats.n_plain_rounds == 0 and stats.n_drafted == 3 * stats.n_rounds
    finally:
        stage.close()


def test_a_speculative_stage_routes_its_windows_and_equals_plain(packed_dirs, tmp_path):
    """A speculative run's stage (StageConfig.route_windows, as `--pipeline --draft` sets it) routes the layers its
    windows keep missing, as one process's speculative decoder: misses are read at route syncs, not repaired.
    Without it the windows take one sync and repairs. Same greedy tokens either way."""
    from runtime.checkpoints.tiny import make_tiny
    from runtime.decode import SpecConfig, load_drafter, make_drafter
    from runtime.pipeline import PipelineDriver, PipelineSpeculative, generate_plain, pipeline_predictor

    path = packed_dirs["qwen3_moe"]
    ids, n = [5, 9, 14, 3, 7, 21, 30, 11], 16
    counts = {}
    for route in (True, False):
        stage = Stage.load(path, 0, 1, StageConfig(budget="50%", route_windows=route))
        try:
            draft_model, draft_config = load_drafter(make_tiny(tmp_path / f"drafter{route}", "qwen3", seed=7, layers=2),
                                                     stage)
            plain, _ = generate_plain(PipelineDriver(stage, _OneRank()), ids, max_tokens=n)
            stage.reset(0)
            routed0, repairs0 = stage.device_pass.stats.routed, stage.device_pass.stats.repairs
            windows = []  # per verify window: (tokens, demand reads of its forward)
            add = stage.window_reads.add
            stage.window_reads.add = lambda routing, reads, t: (windows.append((t, sum(map(len, reads.values())))),
                                                                add(routing, reads, t))
            driver = PipelineDriver(stage, _OneRank())
            spec = PipelineSpeculative(driver, make_drafter(draft_model, "none"),
                                       pipeline_predictor("none", stage, draft_model, draft_config),
                                       SpecConfig(num_draft=3, adaptive_k=False))
            tokens, stats = spec.generate(ids, n)
            assert tokens == plain
            counts[route] = (stage.device_pass.stats.routed - routed0, stage.device_pass.stats.repairs - repairs0)
            # Every demand read of a verify window is booked to the window tokens that routed to it, as in one process
            # (runtime/decode/window_reads.py); the ranks' counts reach rank 0's stats and summary line.
            w = stage.window_reads
            assert w.windows == sum(t > 1 for t, _ in windows) >= stats.n_rounds - 1
            assert w.total == sum(r for t, r in windows if t > 1) > 0
            assert w.first_only + w.middle_only + w.last_only + w.shared > w.unrouted  # the routing was observed
            stats.ranks = driver.stop()
            assert stats.window_reads.to_json() == w.to_json() == stats.to_json()["window_reads"]
            assert "verify reads" in stats.line()
        finally:
            stage.close()
    assert counts[True][0] > 0 and counts[False][0] == 0, counts
    assert counts[True][1] < counts[False][1], counts


def test_a_stage_prefill_reads_each_routed_expert_once_per_layer(packed_dirs):
    """A prefill window routes to more experts than a layer's slots: the stage's synced layer call runs
    expert-major (runtime/cache/expert_major.py), so each routed expert is read at most once per layer."""
    stage = Stage.load(packed_dirs["qwen3_moe"], 0, 1, StageConfig(budget="25%"))
    try:
        routed: dict[int, np.ndarray] = {}
        for m in stage.modules.values():
            m.observer = lambda layer, ids: routed.__setitem__(layer, np.unique(ids))
        prompt = [int(x) for x in np.random.default_rng(0).integers(3, 200, 48)]
        stage.run(stage.embed_tokens(prompt), kind="prefill")
        stats = stage.cache.stats()
        assert set(routed) == set(stage.modules)
        assert any(len(routed[l]) > stage.cache.usable_slots(l) for l in routed)  # token groups would evict each other
        for l, experts in routed.items():
            assert 0 < stats[l].misses <= len(experts), (l, stats[l].misses, len(experts))
    finally:
        stage.close()
