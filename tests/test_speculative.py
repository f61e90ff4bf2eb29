"""Speculative decoding: lossless greedy output, the target's sampling distribution, rewinds."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from predictor.oracle import RoutingRecorder
from runtime.decode.pairing import build_predictor, make_drafter
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.sampling import accept_sampled, probabilities
from runtime.decode.speculative_run import run_speculative
from runtime.decode.speculative import SpecConfig, SpeculativeDecoder
from runtime.checkpoints.tiny import make_tiny
from tests.conftest import PROMPT, TINY, greedy_ids

N = 20
PREDICTORS = ["none", "previous", "popularity", "spmoe", "oracle"]


@pytest.fixture(scope="module")
def dense_drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


def _min_budget(path) -> str:
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    b = om.plan.min_bytes
    om.close()
    return f"{b}B"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("budget", ["50%", "min"])
def test_greedy_speculative_equals_plain_greedy(family, budget, tiny_dirs, dense_drafter):
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget=_min_budget(path) if budget == "min" else budget))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        related, _ = load(str(path))  # the target's own weights, fully resident: a drafter that agrees
        for predictor in PREDICTORS:
            for name, (dmodel, dconfig) in {"random": dense_drafter, "related": (related, om.config)}.items():
                tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor=predictor,
                                                   cutoff=None, draft_model=dmodel, draft_config=dconfig)
                assert tokens == expected, f"{family} {budget} {predictor} {name}"
                assert stats.n_tokens == N
                if name == "related":
                    assert stats.acceptance == 1.0
                elif family == "qwen3_next":
                    assert stats.n_reruns > 0  # rejected drafts rewound the GatedDeltaNet state by re-running
    finally:
        om.close()


def test_accept_sampled_reproduces_the_target_distribution():
    rng = np.random.default_rng(0)
    V, K, draws = 6, 3, 30000
    p = rng.dirichlet(np.ones(V) * 0.7, size=K + 1)
    q = rng.dirichlet(np.ones(V) * 0.7, size=K)
    first = np.zeros(V)
    accepted = 0
    for _ in range(draws):
        draft = [int(rng.choice(V, p=q[i])) for i in range(K)]
        n, token = accept_sampled(draft, q, p, rng)
        first[draft[0] if n > 0 else token] += 1
        accepted += n > 0
    expected = p[0] * draws
    chi2 = ((first - expected) ** 2 / expected).sum()
    assert chi2 < 20.5, (chi2, first, expected)  # df = 5, p = 0.001
    assert 0 < accepted < draws  # both the accept and the residual path were taken
    # The drafter's distribution alone would fail the same test.
    wrong = q[0] * draws
    assert ((first - wrong) ** 2 / wrong).sum() > 100


def test_top_p_distribution():
    logits = mx.array([[2.0, 1.0, 0.5, -1.0]])
    p = np.array(probabilities(logits, 1.0, 0.7))[0]
    full = np.exp([2.0, 1.0, 0.5, -1.0]) / np.exp([2.0, 1.0, 0.5, -1.0]).sum()
    assert p[2] == 0 and p[3] == 0 and abs(p.sum() - 1) < 1e-6  # 0.61 + 0.23 reaches 0.7 at the second token
    assert abs(p[0] / p[1] - full[0] / full[1]) < 1e-5


@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution(tiny_dirs, dense_drafter):
    """First emitted token of many independent runs vs the target's own p (temperature 0.1)."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        temp = 0.1
        p = np.array(probabilities(om.model(mx.array(ids)[None])[0, -1], temp), np.float64)
        dmodel, dconfig = dense_drafter
        counts = np.zeros_like(p)
        draws, accepted_first = 600, 0
        for seed in range(draws):
            pred = build_predictor("none", om, dmodel, dconfig)
            dec = SpeculativeDecoder(om, make_drafter(dmodel, "none"), pred, SpecConfig(num_draft=2, temp=temp, seed=seed))
            first = dec.step(dec.prefill(ids))[0]
            counts[first] += 1
            accepted_first += dec.stats.n_accepted > 0
        order = np.argsort(-p)
        big = [t for t in order if p[t] * draws >= 5]
        obs = np.append(counts[big], draws - counts[big].sum())
        exp = np.append(p[big] * draws, draws - p[big].sum() * draws)
        keep = exp > 0
        chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
        df = keep.sum() - 1
        critical = {3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9}[df]  # p = 0.001
        assert chi2 < critical, (chi2, obs, exp)
        assert 0 < accepted_first < draws
    finally:
        om.close()


def test_forecast_scores_match_the_routing_of_verify(tiny_dirs, dense_drafter):
    """previous-round recall, computed by hand from a recording of the same run."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        dmodel, dconfig = dense_drafter
        recorder = RoutingRecorder()
        SpeculativeDecoder(om, make_drafter(dmodel, "none"), recorder, SpecConfig(num_draft=3, cutoff=0)).generate(ids, N)
        _, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="previous", cutoff=None,
                                      draft_model=dmodel, draft_config=dconfig)
        rounds = recorder.rounds
        assert stats.n_rounds == len(rounds)
        limit = 2 * om.top_k  # the default cap on experts forecast per layer
        for layer in om.moe_layers:
            actual = [set(np.unique(r[layer]).tolist()) for r in rounds]
            counts = [Counter(r[layer].reshape(-1).tolist()) for r in rounds]
            predicted = [set(sorted(c, key=lambda e: (-c[e], e))[:limit]) for c in counts]
            hits = sum(len(f & a) for f, a in zip(predicted, actual[1:]))
            forecast = sum(len(f) for f in predicted[:-1])
            s = stats.per_layer[layer]
            assert (s.hits, s.actual, s.forecast) == (hits, sum(map(len, actual)), forecast)
        _, oracle, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="oracle", cutoff=None,
                                       draft_model=dmodel, draft_config=dconfig)
        assert oracle.recall() == 1.0 and oracle.precision() == 1.0
        assert oracle.counters["prefetch_hits"] > 0
    finally:
        om.close()


def test_prefetch_is_protected_until_its_layer_is_verified_and_stale_reads_cancelled(packed_dirs):
    from storage import ExpertKey

    om = OffloadedModel.load(packed_dirs["qwen3_moe"], OffloadConfig(budget="25%", threads=1))
    try:
        layer = om.moe_layers[0]
        keys = [ExpertKey(layer, e) for e in range(4)]
        om.cache.prefetch(keys, round_id=1)
        ls = om.cache.table.layers[layer]
        assert all(ls.pins[om.cache.table.slot_of(k)] > 0 for k in keys if om.cache.table.slot_of(k) >= 0)
        om.loader.cancel_stale(2)
        om.loader.drain()
        om.cache.unprotect(layer)
        assert (ls.pins == 0).all()
        st = ls.stats
        assert st.prefetch_loaded + st.prefetch_cancelled == 4
        # A valid or free slot only: nothing is left loading or pinned.
        assert set(np.unique(ls.state).tolist()) <= {0, 2}
    finally:
        om.close()
