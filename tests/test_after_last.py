"""The forward after the last token (runtime/decode/offloaded_step.py, `after_last`).

A device-pass generation that keeps nothing past its last token (no prompt cache, no trace, no observer) does not
build the forward that feeds that token: stock mlx-lm's generate_step queues it but nobody waits for it, while the
engine used to finish it before the last token's response and inside the decode time (one extra forward per
generation: over tokens 3..10 on a 6-layer gpt-oss-20b-shaped checkpoint, 1.12x stock's CPU per token with it,
0.96x without, bench/results/gpt_oss_resident.txt). A kept prompt cache still gets it (the last token's KV).
Tokens equal stock's.
"""

from __future__ import annotations

import pytest
from mlx_lm import load as stock_load

import runtime.decode.plain as plain
from runtime import load, stream_generate
from runtime.decode.prompt_cache import PromptCache
from tests.conftest import PROMPT, greedy_ids

N = 6


def _run(engine, ids, **kwargs):
    """(tokens, GenerationStats) of one generation of N tokens."""
    responses = list(stream_generate(engine, ids, max_tokens=N, **kwargs))
    return [r.token for r in responses], responses[-1].detail


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_a_full_budget_generation_runs_one_forward_per_token(tiny_dirs, family, monkeypatch):
    path = tiny_dirs[family]
    model, tok = stock_load(str(path))
    ids = tok.encode(PROMPT)
    ref = greedy_ids(model, ids, N)
    with load(path, budget="100%", memory_limit=None) as engine:
        tokens, stats = _run(engine, ids)
        assert tokens == ref
        assert stats.decode_path == "device pass"
        assert stats.one_sync_tries == N  # the forwards of tokens 1..N, none after the last

        # A kept prompt cache needs the last token's KV: the forward after it runs, and the cache holds it.
        pc = PromptCache(engine.model.model)
        tokens, stats = _run(engine, ids, prompt_cache=pc)
        assert tokens == ref
        assert stats.one_sync_tries == N + 1
        assert len(pc.tokens) == len(ids) + N and pc.cache[0].offset == len(ids) + N

        # Planted: the forward after the last token always built (the earlier behaviour) -- the count catches it.
        real = plain.offloaded_generate_step
        monkeypatch.setattr(plain, "offloaded_generate_step", lambda *a, **kw: real(*a, **{**kw, "after_last": True}))
        tokens, stats = _run(engine, ids)
        assert tokens == ref
        assert stats.one_sync_tries == N + 1
