"""Speculative sampling keeps mlx-lm's sampler exactly, its top-p, min-p and top-k filters included.

`probabilities()` must be the distribution `mlx_lm.sample_utils.make_sampler` draws from; a
speculative run with filters must emit only tokens the target's filtered distribution allows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from runtime.decode import OffloadConfig, OffloadedModel, Sampling, SpecConfig, SpeculativeDecoder
from runtime.decode import make_drafter
from runtime.decode.pairing import build_predictor
from runtime.decode.sampling import probabilities
from tests.conftest import PROMPT, long_tier
from tests.goodness_of_fit import chi2_critical, chi2_stat, pooled_counts

LOGITS = mx.array([3.0, 2.4, 2.0, 1.6, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
SETTINGS = [dict(temp=0.5, top_p=0.8), dict(temp=1.4, min_p=0.15), dict(temp=0.7, top_k=3),
            dict(temp=1.2, top_p=0.9, min_p=0.05, top_k=5)]


def _mlx_lm_draws(temp, top_p=1.0, min_p=0.0, top_k=0, n=6000, seed=0) -> np.ndarray:
    """Token counts from mlx-lm's own sampler on LOGITS (its generate_step passes log-probabilities)."""
    mx.random.seed(seed)
    sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    logprobs = LOGITS - mx.logsumexp(LOGITS)
    tokens = np.array(sampler(mx.broadcast_to(logprobs, (n, LOGITS.size))))
    return np.bincount(tokens, minlength=LOGITS.size).astype(float)


def _fit(counts: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    if (counts[p == 0] > 0).any():
        return float("inf"), 0.0  # a token the distribution forbids was drawn
    obs, exp = pooled_counts(counts[p > 0], p[p > 0] * counts.sum())
    return chi2_stat(obs, exp), chi2_critical(len(obs) - 1, 0.001)


def _filters_after_temperature(temp, top_p=1.0, min_p=0.0, top_k=0) -> np.ndarray:
    """The wrong order (the temperature first, then the filters): what this module did before."""
    return np.array(probabilities(LOGITS / temp, 1.0, top_p, top_k, min_p), np.float64)


# By default top-k alone and all four filters at once; each filter alone with the temperature in the long tier.
@pytest.mark.parametrize("setting", long_tier(SETTINGS, keep=[SETTINGS[2], SETTINGS[3]]),
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_probabilities_is_the_distribution_mlx_lm_samples(setting):
    counts = _mlx_lm_draws(**setting)
    p = np.array(Sampling(**setting).probabilities(LOGITS), np.float64)
    assert abs(p.sum() - 1) < 1e-5
    chi2, critical = _fit(counts, p)
    assert chi2 < critical, (setting, chi2, critical)


def test_filters_applied_after_the_temperature_are_caught():
    """The check above is able to fail: the wrong filter order keeps a different set of tokens."""
    for setting in (SETTINGS[0], SETTINGS[1]):
        chi2, critical = _fit(_mlx_lm_draws(**setting), _filters_after_temperature(**setting))
        assert chi2 > critical, setting


def test_bad_sampler_settings_are_refused_with_the_flag_named():
    with pytest.raises(ValueError, match="--top-k"):
        Sampling(temp=1.0, top_k=-1)
    with pytest.raises(ValueError, match="--min-p"):
        SpecConfig(temp=1.0, min_p=1.5)
    with pytest.raises(ValueError, match="--top-p"):
        Sampling(temp=1.0, top_p=0.0)


def test_speculative_sampling_emits_only_tokens_the_filters_allow(tiny_dirs, tmp_path):
    """A random tiny target has nearly flat distributions, so without the filters almost every
    round would emit a token outside the target's top 2 or below min-p; with them, none may."""
    from runtime.checkpoints.tiny import make_tiny
    from tests.conftest import TINY

    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    drafter_path = make_tiny(tmp_path / "d", "qwen3", seed=9, layers=TINY["layers"])
    dmodel, _ = load(str(drafter_path))
    reference, _ = load(str(path))
    try:
        ids = om.tokenizer.encode(PROMPT)
        for setting in (dict(top_k=2), dict(min_p=0.9)):
            cfg = SpecConfig(num_draft=3, temp=1.0, seed=1, adaptive_k=False, **setting)
            dec = SpeculativeDecoder(om, make_drafter(dmodel, "none"), build_predictor("none", om, dmodel, {}), cfg)
            out = dec.generate(ids, 24, ())
            logits = reference(mx.array(ids + out)[None])[0, len(ids) - 1: -1]
            allowed = np.array(cfg.sampling.probabilities(logits)) > 0
            assert all(allowed[t, tok] for t, tok in enumerate(out)), setting
            assert allowed.sum(axis=1).max() <= (2 if "top_k" in setting else 8)  # the filter cut the vocabulary
            assert dec.stats.n_drafted > 0
            om.empty_cache()
    finally:
        om.close()
