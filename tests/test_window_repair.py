"""A verify window that misses an expert is repaired from its first missing layer, not from layer 0
(runtime/decode/device_pass.py, runtime/decode/layer_replay.py): the layers before it keep their outputs
and state, the layers from it on are called with the arguments (the mask) of the first build, and the
logits and the state after the window are the normal path's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from runtime.decode import LayerReplay
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.rollback import roll_back, snapshot_untrimmable
from storage import ExpertKey
from tests.conftest import PROMPT, TINY

W = 4  # window tokens


def _normal(path, ids, n):
    """The synced path's logits for the last n tokens of ids and for the token after them (fresh model)."""
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-n])[None], cache=cache))
        out = om.model(mx.array(ids[-n:])[None], cache=cache)
        nxt = om.model(mx.array(ids[-1:])[None], cache=cache)
        mx.eval(out, nxt)
        return out, nxt
    finally:
        om.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "deepseek_v2"])
def test_a_window_missing_only_in_its_last_moe_layer_recomputes_only_that_layer(family, tiny_dirs):
    path = tiny_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        cache = make_prompt_cache(om.model)
        mx.eval(om.model(mx.array(ids[:-W])[None], cache=cache))
        snapshot = snapshot_untrimmable(cache)
        seen = {}
        om.set_observer(lambda layer, e: seen.setdefault(layer, []).append(e.copy()))
        mx.eval(om.model(mx.array(ids[-W:])[None], cache=cache))  # the window's experts are resident now
        om.set_observer(None)
        for m in om.modules.values():
            m.release_pending()
        roll_back(cache, snapshot, W)  # GatedDeltaNet state (qwen3_next) is restored, KV trimmed
        last = om.moe_layers[-1]
        window = set(np.unique(np.concatenate(seen[last])).tolist())
        others = [e for e in range(TINY["n_experts"]) if e not in window][: om.cache.n_slots(last)]
        om.cache.prefetch([ExpertKey(last, e) for e in others], round_id=1)  # evicts the window's experts there
        om.loader.drain()
        om.cache.unprotect()
        assert om.cache.table.layers[last].is_absent(sorted(window)).all()
        for layer in om.moe_layers[:-1]:
            assert not om.cache.table.layers[layer].is_absent(np.unique(np.concatenate(seen[layer]))).any()

        dp = DevicePass(om)
        out = dp.run(lambda: om.model(mx.array(ids[-W:])[None], cache=cache), cache, W)
        normal, normal_next = _normal(path, ids, W)
        assert mx.array_equal(out, normal).item()
        assert dp.stats.repairs == 1 and dp.stats.host_syncs == 2
        # Before: a window recomputed every decoder layer. Now only those from the last MoE layer's.
        assert dp.stats.recomputed_layers == len(cache) - om.decoder_index[last]
        assert dp.stats.recomputed_layers < len(cache)
        # The caches the window wrote are the normal path's: the next token's logits agree.
        assert mx.array_equal(om.model(mx.array(ids[-1:])[None], cache=cache), normal_next).item()
    finally:
        om.close()


class _Add(nn.Module):
    """A toy decoder layer: adds its argument (a stand-in for a mask built from the first cache's offset)."""

    def __call__(self, x, arg):
        return x + arg


def _toy():
    layers = [_Add() for _ in range(3)]
    replay = LayerReplay(layers)
    offset = {"v": 0}

    def forward(x):
        arg = mx.array(offset["v"])  # built before the layers from "cache 0", as a window's mask is
        h = x
        for i, layer in enumerate(layers):
            h = layer(h, arg)
            if i == 0:
                offset["v"] += 10  # layer 0 ran: "its cache" advanced (a skipped layer 0 does not run)
        return h

    return replay, forward, offset


def test_a_replayed_forward_reuses_the_first_builds_arguments_when_asked():
    replay, forward, offset = _toy()
    x = mx.array(1)
    replay.start()
    first = forward(x)  # every layer sees 0
    assert first.item() == 1
    replay.skip(1, same_args=True)
    assert forward(x).item() == first.item()  # layers 1, 2 get the first build's 0, not the advanced 10
    replay.stop()


def test_without_the_same_arguments_a_replayed_forward_sees_the_advanced_offset():
    """Why same_args exists: the rebuilt forward's own argument comes from a cache the kept layer advanced."""
    replay, forward, offset = _toy()
    x = mx.array(1)
    replay.start()
    first = forward(x)
    replay.skip(1)
    assert forward(x).item() == first.item() + 20
    replay.stop()


def test_same_args_needs_recorded_arguments():
    replay, forward, _ = _toy()
    replay.start()
    forward(mx.array(1))
    replay.args.clear()
    with pytest.raises(RuntimeError, match="same arguments"):
        replay.skip(1, same_args=True)
    replay.stop()
