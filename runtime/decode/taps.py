"""HiddenTaps: read a model's per-layer hidden states without editing mlx-lm.

Every decoder layer of the mlx-lm families we use computes
    h = x + attention(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))
so the inputs of the two norms are the layer input x and the post-attention
residual h, and h - x is the attention output. We swap the class of those two
norm *instances* for a subclass that records its input, then restore it:
parameter names are unchanged and no mlx-lm class is modified, so other models
in the process are untouched.

Invariant: while enabled, each model call appends one record per layer:
layer -> (input x, residual h), arrays of shape (B, L, D) as the model saw them.
"""

from __future__ import annotations

import mlx.core as mx

_TAPPED_CLASSES: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED_CLASSES:
        def __call__(self, x, *args, **kwargs):
            self._tap_sink(self._tap_key, x)
            return cls.__call__(self, x, *args, **kwargs)

        _TAPPED_CLASSES[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED_CLASSES[cls]


class HiddenTaps:
    def __init__(self, model):
        self.model = model
        self.enabled = False
        self.records: dict[int, dict[str, mx.array]] = {}
        self._installed = []
        for i, layer in enumerate(model.layers):
            for attr, kind in (("input_layernorm", "x"), ("post_attention_layernorm", "h")):
                norm = getattr(layer, attr, None)
                if norm is None:
                    raise ValueError(f"layer {i} of {type(model).__module__} has no {attr}; cannot tap it")
                original = type(norm)
                object.__setattr__(norm, "_tap_sink", self._sink)
                object.__setattr__(norm, "_tap_key", (i, kind))
                norm.__class__ = _tapped_class(original)
                self._installed.append((norm, original))

    def _sink(self, key, x) -> None:
        if self.enabled:
            layer, kind = key
            self.records.setdefault(layer, {})[kind] = x

    def take(self) -> dict[int, dict[str, mx.array]]:
        """The records since the last take(), then clear."""
        out, self.records = self.records, {}
        return out

    def remove(self) -> None:
        for norm, original in self._installed:
            norm.__class__ = original
        self._installed = []
