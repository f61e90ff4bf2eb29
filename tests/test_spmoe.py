"""spmoe forecasting: routing only the new draft tokens each step gives the forecast of routing all."""

from __future__ import annotations

import numpy as np
from mlx_lm import load

from runtime.decode.pairing import build_predictor, make_drafter
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.checkpoints.tiny import make_tiny
from tests.conftest import PROMPT, TINY


def _pair(tiny_dirs, tmp_path):
    """The tiny qwen3_moe target at 50%, a dense qwen3 drafter of its width, and the drafter's config."""
    dmodel, _ = load(str(make_tiny(tmp_path / "d", "qwen3", seed=9, layers=TINY["layers"])))
    dconfig = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}
    return OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%")), dmodel, dconfig


def _spmoe(om, dmodel, dconfig):
    """spmoe taking k experts per window token, up to 64 a layer: a fresh predictor (no round seen)."""
    return build_predictor("spmoe", om, dmodel, dconfig, limit=64)


def test_incremental_forecast_equals_forecast_from_scratch(tiny_dirs, tmp_path):
    om, dmodel, dconfig = _pair(tiny_dirs, tmp_path)
    try:
        live = _spmoe(om, dmodel, dconfig)
        drafter = make_drafter(dmodel, "spmoe")
        drafter.prefill(om.tokenizer.encode(PROMPT))
        for _ in range(2):  # two rounds: the predictor must start afresh with each round's taps
            steps = []
            result = drafter.propose(3, on_step=lambda taps: steps.append(live.forecast(taps, om.moe_layers)))
            drafter.settle(1, result.tokens[1])
            assert len(steps) == 3  # steps 1 and 2 while the next is queued, then the round's end
            fresh = _spmoe(om, dmodel, dconfig)
            whole = fresh.forecast(result.taps, om.moe_layers)
            for layer in om.moe_layers:
                np.testing.assert_array_equal(steps[-1].experts(layer), whole.experts(layer))
                np.testing.assert_allclose(steps[-1].layers[layer].scores, whole.layers[layer].scores, rtol=1e-6)
                assert len(whole.experts(layer)) >= om.top_k  # k per token, union over the fed tokens
        drafter.taps.remove()
    finally:
        om.close()


def test_pipelined_greedy_round_forecasts_each_step_from_its_ready_tokens(tiny_dirs, tmp_path):
    """A greedy round queues step i+1 before on_step sees step i (mlx-lm's draft loop): each on_step finds the next
    step built already, and its forecast covers exactly the ready tokens, as a step-by-step loop's would; the
    proposals are the drafter's own greedy tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from predictor.base import DraftTaps

    om, dmodel, dconfig = _pair(tiny_dirs, tmp_path)
    try:
        live = _spmoe(om, dmodel, dconfig)
        drafter = make_drafter(dmodel, "spmoe")
        prompt = om.tokenizer.encode(PROMPT)
        drafter.prefill(prompt)
        seen, steps = [], []

        def on_step(taps):
            seen.append((taps.n_ready, taps.n_tokens))
            steps.append(live.forecast(taps, om.moe_layers))

        result = drafter.propose(4, on_step=on_step, on_taps=lambda taps: live.prepare(taps, om.moe_layers))
        # Steps 1-3 are forecast while the next one is queued; the last once every step is in.
        assert seen == [(1, 2), (2, 3), (3, 4), (4, 4)]
        for n, got in zip((1, 2, 3, 4), steps):
            prefix = DraftTaps(result.taps.residual[:n], result.taps.attention[:n])
            want = _spmoe(om, dmodel, dconfig).forecast(prefix, om.moe_layers)
            for layer in om.moe_layers:
                np.testing.assert_array_equal(got.experts(layer), want.experts(layer))
        # The proposals are the drafter model's greedy tokens, fed one at a time.
        cache, tokens, feed = make_prompt_cache(dmodel), [], prompt[-1:]
        dmodel(mx.array(prompt[:-1])[None], cache=cache)  # as prefill() feeds it
        for _ in range(4):
            logits = dmodel(mx.array(feed)[None], cache=cache)[0, -1]
            tokens.append(int(mx.argmax(logits).item()))
            feed = [tokens[-1]]
        assert result.tokens == tokens
        drafter.taps.remove()
    finally:
        om.close()


def test_router_bank_matches_the_layer_modules(tmp_path):
    import mlx.core as mx

    from predictor.projection import Projections
    from predictor.router_bank import RouterBank
    from runtime.checkpoints.embedded import embedded_pair

    om = OffloadedModel.load(embedded_pair().target, OffloadConfig(budget="25%"))
    try:
        routers, layers = om.routers(), om.moe_layers
        rng = np.random.default_rng(0)
        width = 128
        proj = Projections({l: rng.normal(0, 0.1, (width + 1, width)) for l in layers}, {})
        for projections in (None, proj):
            bank = RouterBank.from_routers(routers, layers, projections)
            assert bank is not None  # RMSNorm and an 8-bit quantized gate: stackable
            h = mx.array(rng.normal(0, 1, (len(layers), 5, width)).astype(np.float32))
            got = np.array(bank.probs(h))
            for i, l in enumerate(layers):
                x = h[i] if projections is None else projections.apply(l, h[i])
                want = np.array(mx.softmax(routers[l].gate(routers[l].norm(x)).astype(mx.float32), axis=-1))
                np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-6)
                assert (np.argsort(-got[i], axis=-1)[:, :4] == np.argsort(-want, axis=-1)[:, :4]).mean() > 0.99
    finally:
        om.close()


def _reference_forecast(probs: np.ndarray, top_k: int, limit):
    """The per-layer ranking spmoe made before it was vectorized: union of each token's top-k', by summed
    probability, ties by expert id."""
    out = []
    for p in probs:  # (T, E)
        k = min(top_k, p.shape[-1])
        union = np.unique(np.argpartition(-p, k - 1, axis=-1)[:, :k])
        score = p[:, union].sum(axis=0)
        order = np.argsort(-score, kind="stable")[:limit]
        out.append((union[order], score[order]))
    return out


def test_vectorized_ranking_equals_the_per_layer_union():
    import mlx.core as mx

    from predictor.base import DraftTaps
    from predictor.spmoe import SpmoePredictor

    rng = np.random.default_rng(3)
    layers = [0, 2, 3, 5]
    for top_k, limit in ((4, None), (6, None), (4, 5), (64, 7)):
        # Probabilities rounded to a few levels: ties between experts are common (ranked by id then).
        probs = np.round(rng.dirichlet(np.ones(64) * 0.3, size=(len(layers), 4)) * 8) / 8
        probs = probs.astype(np.float32)
        pred = SpmoePredictor({l: None for l in layers}, {l: 0 for l in layers}, top_k, limit=limit)
        taps = DraftTaps()
        for t in range(probs.shape[1]):
            taps.residual.append({0: None})
            pred._route = lambda new, ls, t=t: mx.array(probs[:, t : t + len(new)])  # noqa: E731
            got = pred.forecast(taps, layers)
            want = _reference_forecast(probs[:, : t + 1], top_k, limit)
            for l, (experts, scores) in zip(layers, want):
                np.testing.assert_array_equal(got.experts(l), experts)
                np.testing.assert_array_equal(got.layers[l].scores, scores)


def test_a_forecast_prepared_with_the_draft_step_equals_one_routed_on_its_own(tiny_dirs, tmp_path):
    """on_taps: the drafter evaluates the predictor's routing of its new taps with its own token (one host sync);
    the forecasts and the drafted tokens are those of a drafter and predictor that sync apart."""
    from runtime.decode.sampling import Sampling

    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        dconfig = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}
        pairs = []
        for name in ("a", "b"):  # the same drafter weights twice (each drafter taps its own model)
            dmodel, _ = load(str(make_tiny(tmp_path / name, "qwen3", seed=9, layers=TINY["layers"])))
            pred = build_predictor("spmoe", om, dmodel, dconfig)
            drafter = make_drafter(dmodel, "spmoe")
            drafter.prefill(om.tokenizer.encode(PROMPT))
            pairs.append((pred, drafter))
        (prepared, d1), (plain, d2) = pairs
        routes, phase = [], ["prepare"]
        own_route, own_forecast = prepared._route, prepared.forecast

        def forecast(taps, layers):
            phase[0] = "forecast"
            try:
                return own_forecast(taps, layers)
            finally:
                phase[0] = "prepare"

        prepared._route = lambda new, layers: routes.append((phase[0], len(new))) or own_route(new, layers)  # noqa: E731
        prepared.forecast = forecast
        layers = om.moe_layers
        for sampling in (None, Sampling(temp=1.0)):
            got, want = [], []
            r1 = d1.propose(3, sampling=sampling, rng=np.random.default_rng(5),
                            on_step=lambda taps: got.append(prepared.forecast(taps, layers)),
                            on_taps=lambda taps: prepared.prepare(taps, layers))
            r2 = d2.propose(3, sampling=sampling, rng=np.random.default_rng(5),
                            on_step=lambda taps: want.append(plain.forecast(taps, layers)))
            assert r1.tokens == r2.tokens
            assert len(got) == len(want) == 3
            for g, w in zip(got, want):
                for layer in layers:
                    np.testing.assert_array_equal(g.experts(layer), w.experts(layer))
                    np.testing.assert_allclose(g.layers[layer].scores, w.layers[layer].scores, rtol=1e-6)
            d1.settle(0, r1.tokens[0])
            d2.settle(0, r2.tokens[0])
        # Each fed token routed once, by prepare: forecast() routes nothing of its own.
        assert routes == [("prepare", 1)] * 3 * 2
        for _, drafter in pairs:
            drafter.taps.remove()
    finally:
        om.close()
