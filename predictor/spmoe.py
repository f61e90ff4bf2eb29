"""SP-MoE forecasting: the drafter's hidden states through the target's own routers.

Shapes: T = tokens in the verify window (drafter taps), D_d / D_t = drafter /
target width, E = experts, k' = experts taken per token.

For each target layer t: H = drafter residual at layer m(t) for every window token
(T, D_d) -> optional projection (T, D_t) -> target post-attention norm -> target
gate -> softmax (T, E). Each token contributes its top-k' experts; the union is
ranked by summed probability. All layers are computed in one MLX graph (a RouterBank
of stacked weights where the norms and gates allow it) and read
back once per call; tokens already routed in this round (the same taps object)
are not routed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from predictor.base import DraftTaps, ExpertForecast, LayerForecast
from predictor.projection import Projections
from predictor.router_bank import RouterBank


@dataclass(frozen=True)
class TargetRouter:
    layer: int  # target decoder-layer index
    norm: Callable[[mx.array], mx.array]  # the target's post-attention norm of that layer
    gate: Callable[[mx.array], mx.array]  # the target's router: (..., D_t) -> (..., E) logits


class SpmoePredictor:
    name = "spmoe"

    def __init__(self, routers: dict[int, TargetRouter], layer_map: dict[int, int], top_k: int,
                 projections: Projections | None = None, limit: int | None = None, source: str = "residual"):
        if source not in ("residual", "attention"):
            raise ValueError(f"spmoe source={source!r}; expected 'residual' or 'attention'")
        self.routers = routers
        self.layer_map = layer_map  # target layer -> drafter layer
        self.top_k = top_k  # k': experts taken per window token
        self.projections = projections
        self.limit = limit  # experts per layer at most after the union (None: the whole union)
        self.source = source
        self._round_taps: DraftTaps | None = None  # the taps whose tokens self._probs holds
        self._layers: list[int] = []
        self._probs: list[np.ndarray] = []  # per routed token: (layers, E) router probabilities
        self._lazy: list[tuple[int, mx.array]] = []  # prepared, not read yet: (first token, lazy (layers, T, E))
        self._prepared = 0  # tokens of the round's taps routed (read or lazy)
        self._banks: dict[tuple[int, ...], RouterBank | None] = {}  # stacked routers per layer list

    def _start(self, taps: DraftTaps, layers: list[int]) -> tuple[list, list[int]]:
        """The taps' per-token states and the layers with a router; a new round (new taps) starts afresh."""
        per_token = taps.residual if self.source == "residual" else taps.attention
        layers = [l for l in layers if l in self.routers]
        if per_token and layers and (self._round_taps is not taps or self._layers != layers):
            self._round_taps, self._layers, self._probs, self._lazy, self._prepared = taps, layers, [], [], 0
        return per_token, layers

    def prepare(self, taps: DraftTaps, layers: list[int]) -> mx.array | None:
        """The router probabilities of the taps' tokens not routed yet, built lazily: the drafter evaluates
        them with its own step (queued together: runtime/decode/drafter.py), and forecast() then reads them
        without a host sync of its own. None when there is nothing to route."""
        per_token, layers = self._start(taps, layers)
        new = per_token[self._prepared:] if per_token and layers else []
        if not new:
            return None
        lazy = self._route(new, layers)
        self._lazy.append((self._prepared, lazy))
        self._prepared = len(per_token)
        return lazy

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        per_token, layers = self._start(taps, layers)
        if not per_token or not layers:
            return ExpertForecast.empty()
        # Called after every draft step with the round's growing taps: route only the new tokens up to the
        # taps' ready ones (prepared with the drafter's step when the decoder asked for them, see prepare();
        # a pipelined drafter's next step, queued already, is not waited for).
        ready = taps.n_ready
        while len(self._probs) < ready:
            at = len(self._probs)
            if self._lazy and self._lazy[0][0] == at:
                routed = self._lazy.pop(0)[1]
            else:  # never prepared: routed now, up to the next prepared token
                routed = self._route(per_token[at:min([ready] + [s for s, _ in self._lazy[:1]])], layers)
            self._probs += list(np.array(routed).swapaxes(0, 1))  # one host read; per token (layers, E)
        self._prepared = max(self._prepared, len(self._probs))
        if not self._probs:
            return ExpertForecast.empty()
        all_probs = np.stack(self._probs, axis=1)  # (layers, T, E)
        n_layers, _, n_experts = all_probs.shape
        k = min(self.top_k, n_experts)
        # Every layer at once: each token's top-k' (L, T, k'), their union as a mask (L, E), ranked by the
        # summed probability over the window's tokens; ties by expert id (a stable sort of the ids).
        top = np.argpartition(-all_probs, k - 1, axis=-1)[..., :k]
        member = np.zeros((n_layers, n_experts), bool)
        member[np.arange(n_layers)[:, None, None], top] = True
        score = all_probs.sum(axis=1)  # (L, E)
        order = np.argsort(np.where(member, -score, np.inf), axis=-1, kind="stable")
        counts = member.sum(axis=-1).tolist()
        out = {}
        for i, (l, n) in enumerate(zip(layers, counts)):
            experts = order[i, : n if self.limit is None else min(n, self.limit)]
            out[l] = LayerForecast(l, experts.astype(np.int64), score[i, experts])
        return ExpertForecast(out)

    def _route(self, new: list[dict], layers: list[int]) -> mx.array:
        """Router probabilities (layers, T_new, E) of the new tokens' taps."""
        key = tuple(layers)
        if key not in self._banks:
            self._banks[key] = RouterBank.from_routers(self.routers, layers, self.projections)
        bank = self._banks[key]
        if bank is not None:
            # Each drafter layer's tap once ((T_new, D_d) per layer), then one gather to the target layers
            # mapped to it: on a CPU each op's dispatch costs more than its arithmetic (L target layers share
            # fewer drafter layers).
            mapped = [self.layer_map[l] for l in layers]
            sources = sorted(set(mapped))
            flat = lambda a: a if a.ndim == 1 else a.reshape(-1)  # noqa: E731 (taps are (D_d,) already)
            per_token = [mx.stack([flat(tok[m]) for m in sources]) for tok in new]  # each (S, D_d)
            taps = per_token[0][:, None] if len(new) == 1 else mx.stack(per_token, axis=1)  # (S, T, D_d)
            if len(sources) == len(mapped) and sources == mapped:
                return bank.probs(taps)
            return bank.probs(taps[mx.array([sources.index(m) for m in mapped])])  # (L, T, D_d)
        probs = []  # a norm or gate the bank cannot stack: layer by layer with the modules themselves
        for l in layers:
            h = mx.stack([tok[self.layer_map[l]].reshape(-1) for tok in new])  # (T_new, D_d)
            if self.projections is not None:
                h = self.projections.apply(l, h)
            r = self.routers[l]
            probs.append(mx.softmax(r.gate(r.norm(h.astype(mx.float32))).astype(mx.float32), axis=-1))
        return mx.stack(probs)

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        pass
