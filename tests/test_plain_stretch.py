"""K = 0 stretches and greedy probes (runtime/decode/plain_stretch.py, SpeculativeDecoder._plain/_probe): the
target's tokens stay stock's, the target's cache never runs past the pending token, and the drafter's cache
catches up on a stretch's tokens in its next proposal."""

from __future__ import annotations

import pytest
from mlx_lm import load as mlx_load

import runtime.decode.speculative as speculative
from runtime.checkpoints.tiny import make_tiny
from runtime.decode.drafter import ModelDrafter
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import speculative_decoder
from tests.conftest import PROMPT, TINY, greedy_ids

N = 30


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("rnd") / "d", "qwen3", seed=11, layers=TINY["layers"], hidden=32)
    model, _, config = mlx_load(str(path), return_config=True)
    return model, config


def _decoder(om, draft_model, draft_config, **options):
    ids = om.tokenizer.encode(PROMPT)
    return ids, speculative_decoder(om, None, ids, max_tokens=N, num_draft=3, predictor="none", cutoff=None,
                                    draft_model=draft_model, draft_config=draft_config, **options)


@pytest.mark.parametrize("family,budget,one_sync", [("qwen3_moe", "50%", "auto"), ("qwen3_moe", "100%", "auto"),
                                                    ("qwen3_moe", "50%", "on"), ("qwen3_next", "50%", "auto")])
def test_a_never_accepted_drafter_decodes_stock_tokens_through_stretches(family, budget, one_sync, tiny_dirs,
                                                                         random_drafter):
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget=budget))
    try:
        ids, decoder = _decoder(om, *random_drafter, one_sync=one_sync)
        expected = greedy_ids(om.model, ids, N)
        assert decoder.generate(ids, N) == expected
        history = decoder.draft_length.history
        s = decoder.stats
        assert s.n_accepted == 0 and s.n_plain_rounds > N / 2, history
        assert history[0] == [1, 1] and history[1][0] == 0  # the first round is a probe; rejected: a stretch
        assert sum(k == 1 for k, _ in history) >= 2  # probes ran ...
        assert s.one_sync_tries == 0 and s.n_probes == sum(n for k, n in history if k == 1)  # ... with no verify window
    finally:
        om.close()


def test_the_target_cache_ends_at_the_pending_token(tiny_dirs, random_drafter, monkeypatch):
    """Planted: a stretch that feeds its last token to the target (as a pipelined step one past the end would)."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        ids, decoder = _decoder(om, *random_drafter)
        expected = greedy_ids(om.model, ids, N)
        real = speculative.plain_stretch

        def overshoot(target, cache, pending, n, **kw):
            tokens = real(target, cache, pending, n, **kw)
            real(target, cache, tokens[-1], 1, **kw)  # the cache now holds the pending token too
            return tokens

        monkeypatch.setattr(speculative, "plain_stretch", overshoot)
        assert decoder.generate(ids, N) != expected
    finally:
        om.close()


@pytest.mark.parametrize("plant", [None, "drafter not caught up"])
def test_the_drafter_catches_up_on_a_stretch(plant, tiny_dirs, monkeypatch):
    """A drafter that is the target itself agrees with every target token when its cache holds the same context:
    after a forced stretch, its probe and every later draft are accepted. Planted: skip() forgets the stretch's
    tokens, so the drafter proposes from a context without them."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        twin, _, config = mlx_load(str(tiny_dirs["qwen3_moe"]), return_config=True)
        ids, decoder = _decoder(om, twin, config)
        decoder.draft_length.k, decoder.draft_length.plain_left = 0, 5  # start with a stretch of 5 plain rounds
        if plant:
            monkeypatch.setattr(ModelDrafter, "skip", lambda self, token: None)
        expected = greedy_ids(om.model, ids, N)
        assert decoder.generate(ids, N) == expected  # lossless either way: the target verifies
        history = decoder.draft_length.history
        assert history[0] == [0, 5]
        if plant is None:
            assert history[1] == [1, 1] and decoder.stats.acceptance == 1.0, history
        else:
            assert decoder.stats.acceptance < 1.0, history
    finally:
        om.close()


def test_sampled_stretches_draw_from_the_decoder_generator(tiny_dirs, random_drafter):
    """temp > 0: a stretch samples each token on the host with one uniform from the decoder's generator, so a
    seed fixes the run (forced here: the tiny random models agree too often when sampling to fall back)."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        runs = []
        for seed in (7, 7, 8):
            ids, decoder = _decoder(om, *random_drafter, temp=1.0, seed=seed)
            decoder.draft_length.k, decoder.draft_length.plain_left = 0, N
            runs.append((decoder.generate(ids, N), decoder.stats))
        (a, sa), (b, _), (c, _) = runs
        assert a == b and a != c
        assert sa.n_plain_rounds == N and sa.one_sync_tries == 0
    finally:
        om.close()
