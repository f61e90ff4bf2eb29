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
from runtime.decode.sampling import accept_sampled, probabilities, sample
from runtime.decode.speculative_run import run_speculative
from runtime.decode.speculative import SpecConfig, SpeculativeDecoder
from runtime.checkpoints.tiny import make_tiny
from tests.conftest import PROMPT, TINY, greedy_ids, long_tier
from tests.goodness_of_fit import chi2_critical, chi2_stat, pit, pooled_counts, uniformity_chi2

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
@pytest.mark.parametrize("budget", long_tier(["50%", "min"], keep={"min"}))  # the smallest cache misses the most
def test_greedy_speculative_equals_plain_greedy(family, budget, tiny_dirs, dense_drafter):
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget=_min_budget(path) if budget == "min" else budget))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N)
        related, _ = load(str(path))  # the target's own weights, fully resident: a drafter that agrees
        for predictor in PREDICTORS:
            for name, (dmodel, dconfig) in {"random": dense_drafter, "related": (related, om.config)}.items():
                # Fixed K: the random drafter's rounds are verify windows too (adaptive K would probe and stop)
                tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor=predictor,
                                                   cutoff=None, draft_model=dmodel, draft_config=dconfig,
                                                   adaptive_k=False)
                assert tokens == expected, f"{family} {budget} {predictor} {name}"
                assert stats.n_tokens == N
                if name == "related":
                    assert stats.acceptance == 1.0
                elif family == "qwen3_next":
                    assert stats.n_reruns > 0  # rejected drafts rewound the GatedDeltaNet state by re-running
    finally:
        om.close()


def _draw(q_row: np.ndarray, n: int, rng) -> np.ndarray:
    return np.minimum(np.searchsorted(np.cumsum(q_row), rng.random(n), side="right"), len(q_row) - 1)


def _emitted_by_position(sampler, p, q, draws: int, seed: int = 0) -> np.ndarray:
    """counts[j, t]: rounds whose j-th emitted token was t (j = K: the bonus token)."""
    rng = np.random.default_rng(seed)
    K, V = q.shape
    drafts = np.stack([_draw(q[i], draws, rng) for i in range(K)], axis=1).tolist()
    counts = np.zeros((K + 1, V))
    for draft in drafts:
        n, token = sampler(draft, q, p, rng)
        for j, t in enumerate(draft[:n] + [token]):
            counts[j, t] += 1
    return counts


def _position_scores(counts: np.ndarray, p: np.ndarray) -> list[tuple[float, float]]:
    """(chi-square, critical value at p = 0.001 / (K + 1)) of each position's tokens against p[j]."""
    out = []
    for j in range(len(counts)):
        obs, exp = pooled_counts(counts[j], p[j] * counts[j].sum())
        out.append((chi2_stat(obs, exp), chi2_critical(len(obs) - 1, 0.001 / len(counts))))
    return out


def _wrong_later(draft, q, p, rng):
    """Right at the first position; at later ones the residual is p itself (not max(p - q, 0)),
    and the bonus token comes from the previous position's p."""
    for i, d in enumerate(draft):
        if rng.random() * q[i, d] < p[i, d]:
            continue
        return i, sample(p[i] if i > 0 else np.maximum(p[i] - q[i], 0) / np.maximum(p[i] - q[i], 0).sum(), rng)
    return len(draft), sample(p[len(draft) - 1], rng)


def _wrong_bonus(draft, q, p, rng):
    n, token = accept_sampled(draft, q, p, rng)
    return (n, sample(q[-1], rng)) if n == len(draft) else (n, token)  # the bonus drawn from the drafter


def test_accept_sampled_reproduces_the_target_distribution_at_every_position():
    """Each emitted position j (the bonus token included) follows p[j]; samplers wrong only at
    later positions or only at the bonus token fail the same test."""
    rng = np.random.default_rng(0)
    V, K, draws = 6, 3, 30000
    p = rng.dirichlet(np.ones(V) * 0.7, size=K + 1)
    q = rng.dirichlet(np.ones(V) * 0.7, size=K)
    counts = _emitted_by_position(accept_sampled, p, q, draws)
    scores = _position_scores(counts, p)
    assert all(chi2 < crit for chi2, crit in scores), scores
    assert counts[K].sum() > 300 and 0 < counts[1].sum() < draws  # the bonus and the residual paths were taken
    # The drafter's distribution alone would fail the first position.
    wrong = q[0] * draws
    assert ((counts[0] - wrong) ** 2 / wrong).sum() > 100
    later = _position_scores(_emitted_by_position(_wrong_later, p, q, draws), p)
    assert later[0][0] < later[0][1] and any(c > crit for c, crit in later[1:]), later  # only later positions flag
    bonus = _position_scores(_emitted_by_position(_wrong_bonus, p, q, draws), p)
    assert all(c < crit for c, crit in bonus[:K]) and bonus[K][0] > bonus[K][1], bonus


def test_chi2_critical_values():
    for df, table in {1: 10.83, 3: 16.27, 5: 20.52, 9: 27.88, 30: 59.70}.items():
        assert abs(chi2_critical(df) - table) / table < 0.02  # p = 0.001 (any df; no lookup table to fall off)
    obs, exp = pooled_counts(np.array([50.0, 30, 15, 2, 2, 1]), np.array([48.0, 32, 14, 3, 2, 1]))
    assert obs.sum() == 100 and (exp >= 5).all() and len(obs) == 4


def test_top_p_distribution():
    logits = mx.array([[2.0, 1.0, 0.5, -1.0]])
    p = np.array(probabilities(logits, 1.0, 0.7))[0]
    full = np.exp([2.0, 1.0, 0.5, -1.0]) / np.exp([2.0, 1.0, 0.5, -1.0]).sum()
    assert p[2] == 0 and p[3] == 0 and abs(p.sum() - 1) < 1e-6  # 0.61 + 0.23 reaches 0.7 at the second token
    assert abs(p[0] / p[1] - full[0] / full[1]) < 1e-5


SAMPLING_PROMPTS = ["Enter the king and his lords, with attendants.", "The function returns a list of the lines in",
                    "If the argument is omitted, the default value is used, and", "CLAUDIO. Why, how now, Claudio!"]


def _sampled_positions(sampler=None, tokens_per_prompt: int = 100, K: int = 3) -> tuple[dict[int, list[float]], float]:
    """Speculative sampling at temperature 1 with the embedded trained pair; every emitted token's
    randomized PIT under the target's own conditional p (an independent full forward of a resident
    copy), grouped by its position in the round (K: the bonus token). Returns (pit by position, acceptance)."""
    import runtime.decode.speculative as spec_module
    from runtime.checkpoints import embedded_pair
    from runtime.decode.pairing import load_drafter

    pair = embedded_pair()
    om = OffloadedModel.load(pair.target, OffloadConfig(budget="100%", threads=1))
    reference, _ = load(str(pair.target))
    rng = np.random.default_rng(123)
    by_position: dict[int, list[float]] = {j: [] for j in range(K + 1)}
    original = spec_module.accept_sampled
    drafted = accepted = 0
    try:
        if sampler is not None:
            spec_module.accept_sampled = sampler
        dmodel, dconfig = load_drafter(pair.default_drafter, om)
        for seed, prompt in enumerate(SAMPLING_PROMPTS):
            ids = om.tokenizer.encode(prompt)
            dec = SpeculativeDecoder(om, make_drafter(dmodel, "none"), build_predictor("none", om, dmodel, dconfig),
                                     SpecConfig(num_draft=K, temp=1.0, seed=seed, adaptive_k=False))
            pending, out, positions = dec.prefill(ids), [], []
            while len(out) < tokens_per_prompt:
                emitted = dec.step(pending)
                out += emitted
                positions += range(len(emitted))
                pending = emitted[-1]
            drafted, accepted = drafted + dec.stats.n_drafted, accepted + dec.stats.n_accepted
            logits = reference(mx.array(ids + out)[None])[0, len(ids) - 1 : -1]
            p = np.array(probabilities(logits, 1.0), np.float64)
            for t, (token, j) in enumerate(zip(out, positions)):
                by_position[j].append(pit(p[t], token, rng))
    finally:
        spec_module.accept_sampled = original
        om.close()
    return by_position, accepted / drafted


@pytest.mark.slow
@pytest.mark.long  # end to end through the decoder; the sampler's own check above runs by default
def test_speculative_sampling_keeps_the_target_distribution_at_every_position():
    """Trained drafter, temperature 1: the tokens emitted at each position of a round (the
    bonus token included) are distributed as the target's p given everything before them.
    Randomized PIT values of p are Uniform(0, 1) exactly when that holds; each position is
    tested separately (p = 0.001 each). A sampler right only at the first position fails: the
    check the old test made (first emitted token only) passed it.
    (Subtler errors, e.g. drawing rejections from p, need more draws than a test can afford
    here; the per-position test on exact synthetic distributions above catches those.)"""
    by_position, acceptance = _sampled_positions()
    assert 0.2 < acceptance < 0.95  # both the accept and the reject path are exercised
    for j, u in by_position.items():
        assert len(u) >= 60, (j, len(u))  # enough draws for 10 bins, the bonus position included
        chi2, critical = uniformity_chi2(np.array(u))
        assert chi2 < critical, (j, chi2, critical, len(u))
    wrong, _ = _sampled_positions(_wrong_later)
    scores = [uniformity_chi2(np.array(u)) for u in wrong.values()]
    assert scores[0][0] < scores[0][1] and any(chi2 > critical for chi2, critical in scores), scores


def test_forecast_scores_match_the_routing_of_verify(tiny_dirs, dense_drafter):
    """previous-round recall, computed by hand from a recording of the same run."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        dmodel, dconfig = dense_drafter
        recorder = RoutingRecorder()
        # Fixed K: every round drafts and is scored (adaptive K's plain rounds make no forecast and are not
        # scored; the oracle run below keeps adaptive K, and its replay must still line up round by round).
        SpeculativeDecoder(om, make_drafter(dmodel, "none"), recorder,
                           SpecConfig(num_draft=3, cutoff=0, adaptive_k=False)).generate(ids, N)
        _, stats, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="previous", cutoff=None,
                                      draft_model=dmodel, draft_config=dconfig, adaptive_k=False)
        rounds = recorder.rounds
        assert stats.n_rounds - stats.n_plain_rounds == len(rounds)  # the generation's last token is a plain round
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
                                       draft_model=dmodel, draft_config=dconfig, adaptive_k=False)
        assert oracle.recall() == 1.0 and oracle.precision() == 1.0 and oracle.counters["prefetch_hits"] > 0
        # With adaptive K the oracle's recording run and its replay choose the same K every round (probes and
        # plain rounds included), so the replay stays in step and lossless.
        tokens, adaptive, _ = run_speculative(om, None, ids, max_tokens=N, num_draft=3, predictor="oracle",
                                              cutoff=None, draft_model=dmodel, draft_config=dconfig)
        assert tokens == greedy_ids(om.model, ids, N) and adaptive.n_plain_rounds > 0 and adaptive.n_probes > 0
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
