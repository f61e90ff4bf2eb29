"""kv_only: a prompt chunk's forward whose logits nobody reads skips the last decoder layer's experts.

A prefill chunk (every chunk but the one holding the prompt's last token) is run for its KV cache and
recurrent state only: mlx-lm's generate_step evaluates `[c.state for c in cache]` and drops the
logits. The last decoder layer's MoE output feeds only the final norm and the LM head, so stock
mlx-lm, evaluating lazily, never computes that layer's router or experts for such a chunk. An offloaded
MoE layer cannot be lazy -- it reads the router's choice on the host to know what to page in -- so
without this it would route, read and compute the last layer's experts for every prompt token for
nothing (on bench_prefill's 8-layer model that is ~1/8 of the MoE work plus the reads).

Within `with kv_only(om):` the last decoder layer's expert module is, on this model instance only,
a stand-in returning lazy zeros of the SwitchGLU shape: no host sync, no reads, no compute.

Invariants: every cache state a chunk writes is bit-identical to the full forward's (the stand-in's
output reaches no cache; tests/test_kv_only.py checks it for every family); the module is restored on
exit, also after an error; only use it around forwards whose logits are discarded; a model whose last
decoder layer has no expert module, or that records a routing trace (which needs every layer's routing of
every token), is left as it is.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn


class SkippedExperts(nn.Module):
    """Stands in for an expert module whose output no one evaluates: (..., D), (..., k) -> zeros (..., k, D)."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)


def last_layer_experts(om) -> tuple[nn.Module, str] | None:
    """(parent module, attribute) of the expert module inside the model's last decoder layer, or None."""
    last = om.model.layers[-1]
    modules = set(id(m) for m in om.modules.values())
    for name, module in last.named_modules():
        if id(module) in modules and name:
            parent_path, _, attr = name.rpartition(".")
            parent = last
            for p in parent_path.split(".") if parent_path else []:
                parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
            return parent, attr
    return None


@contextmanager
def kv_only(om):
    """Forwards inside skip the last decoder layer's experts (their logits must not be read)."""
    tracing = om is not None and om.telemetry is not None and om.telemetry.tracing
    where = last_layer_experts(om) if om is not None and not tracing else None  # a routing trace needs every layer
    if where is None:
        yield
        return
    parent, attr = where
    module = getattr(parent, attr)
    setattr(parent, attr, SkippedExperts())
    try:
        yield
    finally:
        setattr(parent, attr, module)
