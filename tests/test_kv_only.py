"""kv_only (runtime/decode/kv_only.py): a prefill chunk skips the last decoder layer's experts, and every
cache state it writes is bit-identical to the full forward's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from runtime.checkpoints.tiny import FAMILIES
from runtime.decode.kv_only import SkippedExperts, kv_only, last_layer_experts
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, REPRESENTATIVE_FAMILIES, long_tier

LONG = (PROMPT + " ") * 4


def _states(cache) -> list[np.ndarray]:
    return [np.array(s.astype(mx.float32)) for _, s in tree_flatten([c.state for c in cache]) if isinstance(s, mx.array)]


def _prefill(om, ids, skip: bool):
    cache = make_prompt_cache(om.model)
    routed = []
    om.set_observer(lambda layer, e: routed.append(layer))
    if skip:
        with kv_only(om):
            om.model(mx.array(ids)[None], cache=cache)
    else:
        om.model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    om.set_observer(None)
    return _states(cache), set(routed), om.counters()["misses"]


# Representative families by default (plain KV + switch_mlp, hybrid linear-attention state, rotating KV with MXFP4
# experts and biases, shared experts with grouped routing); every family in the long tier (`pytest -m long`).
@pytest.mark.parametrize("family", long_tier(FAMILIES, keep=REPRESENTATIVE_FAMILIES))
def test_kv_only_chunk_writes_the_same_cache_without_the_last_layers_experts(family, tiny_dirs):
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget="25%"))
    try:
        ids = om.tokenizer.encode(LONG)
        where = last_layer_experts(om)
        # Every family here ends in an MoE layer; one that does not needs its own check, not a silent pass.
        assert where is not None, f"{family}: the last decoder layer has no expert module"
        module = getattr(*where)
        last = next(l for l, m in om.modules.items() if m is module)
        full, routed_full, _ = _prefill(om, ids, skip=False)
        om.empty_cache()
        m0 = om.counters()["misses"]
        skipped, routed_skip, m1 = _prefill(om, ids, skip=True)
        assert getattr(*where) is module  # restored
        assert len(full) == len(skipped) > 0
        for a, b in zip(full, skipped):
            assert np.array_equal(a, b), f"{family}: a cache state differs"
        assert last in routed_full and last not in routed_skip  # the last layer was neither routed nor read
        assert routed_skip == routed_full - {last}
        assert m1 > m0
    finally:
        om.close()


def test_kv_only_restores_the_module_after_an_error(tiny_dirs):
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        where = last_layer_experts(om)
        module = getattr(*where)
        with pytest.raises(RuntimeError):
            with kv_only(om):
                assert isinstance(getattr(*where), SkippedExperts)
                raise RuntimeError("boom")
        assert getattr(*where) is module
    finally:
        om.close()
