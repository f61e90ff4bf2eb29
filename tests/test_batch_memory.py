"""A batch under --memory-limit (runtime/decode/batch_memory.py, runtime/cache/context_governor.py).

The batch's KV caches (every member's, as mlx-lm's BatchGenerator holds them) are reported to the
ContextGovernor, so expert slots give way as the batch grows and come back as members leave. Checked on a
qwen3_moe whose experts are large enough that the cache is most of the process: a cap that holds every slot
beside one sequence's KV but not beside five. Measured after every step, the batch caches' bytes plus the
slots the cache may fill stay under the cap; the tokens equal stock mlx-lm's BatchGenerator with the same
schedule. With the batch's report planted away (the caches not counted), the same measurement goes over the cap.
"""

from __future__ import annotations

import pytest
from mlx_lm import load as stock_load
from test_batch_generate import TEXTS, run_schedule, stock_tokens

from runtime.cache import ContextGovernor, MemoryLimit, activation_bytes
from runtime.checkpoints.tiny import make_tiny
from runtime.decode.batch import BatchDecoder
from runtime.decode.batch_memory import BatchMemory
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel

KV_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # 3 attention layers x K,V x 2 KV heads x head_dim 16 x float32


@pytest.fixture(scope="module")
def wide_experts(tmp_path_factory):
    """qwen3_moe with 512-wide experts: 32 slots of 3 layers take ~7 MB, the KV of a 5-sequence batch ~2 MB."""
    path = make_tiny(tmp_path_factory.mktemp("wide") / "q", "qwen3_moe", seed=3, layers=3, n_experts=32, top_k=4,
                     expert_hidden=512)
    model, tok = stock_load(str(path))
    prompts = [tok.encode(t * (30 if i in (0, 2) else 1)) for i, t in enumerate(TEXTS)]  # two past 256 tokens
    return path, prompts, stock_tokens(model, prompts)


def _run_capped(path, prompts):
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        cache, cfg = om.cache, om.config
        row = sum(cache.layouts[l].expert_bytes for l in cache.layers())
        one_sequence = activation_bytes(cfg, 16, 16) + (16 + 256) * KV_PER_TOKEN
        cap = int((one_sequence + 32 * row) / 0.95) + row  # every slot fits beside one short sequence's KV
        gov = ContextGovernor(cache, MemoryLimit(cap, 0, 0), cfg, 16, kv_per_token=KV_PER_TOKEN)
        om.context_governor = gov
        seen, usable = [], []
        with BatchDecoder(om) as dec:
            def measure(step):  # what the process holds of the parts: the batch's caches and the fillable slots
                slots = cache.usable_now()
                usable.append(min(slots.values()))
                seen.append(dec.generator.prompt_cache_nbytes +
                            sum(n * cache.layouts[l].expert_bytes for l, n in slots.items()))

            got = run_schedule(dec.next, dec.insert, dec.remove, prompts, before_step=measure)
        return got, cap, seen, usable, gov, 32 * row
    finally:
        om.close()


def test_a_batch_under_a_cap_gives_slots_back_and_keeps_the_tokens(wide_experts, monkeypatch):
    path, prompts, expected = wide_experts
    got, cap, seen, usable, gov, all_slots = _run_capped(path, prompts)
    assert got == expected  # stock BatchGenerator, same schedule
    assert max(seen) <= cap and max(seen) > all_slots  # the batch's KV was there, and the slots made room for it
    assert gov.stats.n_shrinks >= 1 and min(usable) < 32  # slots gave way as the batch grew...
    assert gov.stats.n_grows >= 1 and usable[-1] > min(usable)  # ...and came back as members left
    assert min(usable) >= 4  # never below one token's experts: the batch shrank the cache instead of failing

    monkeypatch.setattr(BatchMemory, "observe", lambda self, generator: None)  # planted: batch caches not counted
    got, cap, seen, usable, gov, _ = _run_capped(path, prompts)
    assert got == expected and min(usable) == 32
    assert max(seen) > cap  # the same measurement catches it
