"""Router lookahead: layer l's MoE input pushed through the routers of later layers.

Shapes: T = tokens in the call, D = hidden width, E = experts, m = experts taken per token.

For the qwen3_moe family the MoE block of layer l sees x_l = rms(h_l) * w_l, the
post-attention residual h_l under that layer's RMSNorm (weight w_l), and routes with
gate_l(x_l). Layer t's router applied to the same residual is therefore
gate_t(rms(h_l) * w_t) = gate_t(x_l * w_t / w_l): exactly computable from x_l, no tap
needed. The residual drifts between l and t (attention and MoE outputs are added), which
is the forecast's error; the published one-layer-ahead recall for Qwen3-30B-A3B is 90.6%.

Invariants: forecast() only builds lazy MLX arrays (the caller evaluates them together
with the routing it already reads back, so a forecast costs no extra host sync); the
forecast of a target layer lists distinct expert ids; a layer whose norm weight is zero
somewhere contributes 0 there (the information is lost, not invented).

Confidence: an expert among a token's top m is taken only if the target router gives it at
least `min_prob`; by default DEFAULT_SHARE / E, three times the uniform share of E experts
(chosen by replaying the embedded pair's decoded workload, docs/read-less.md: on that trace a
probability threshold cuts wasted prefetch reads more per demand miss given up than fewer
experts per token, a threshold relative to the top expert, or value-based admission).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class _Hop:
    target: int  # the layer forecast
    distance: int  # MoE layers ahead of the source layer
    scale: mx.array  # (D,) w_target / w_source
    gate: object  # the target's router: (..., D) -> (..., E) logits


DEFAULT_SHARE = 3.0  # default min_prob = DEFAULT_SHARE / n_experts


class RouterLookahead:
    """Forecast layer l + j's experts from layer l's MoE input, for each j in `distances`."""

    def __init__(self, routers: dict, distances: tuple[int, ...] = (1,), per_token: int = 4,
                 targets: set[int] | None = None, min_prob: float | None = None):
        if not distances or min(distances) < 1:
            raise ValueError(f"lookahead distances {distances}; expected layers ahead >= 1")
        if per_token < 1:
            raise ValueError(f"lookahead experts per token {per_token}; expected >= 1")
        self.distances = tuple(sorted(set(distances)))
        self.per_token = per_token  # m: experts taken per token of the call
        if min_prob is not None and not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"lookahead min_prob {min_prob}; expected a probability in [0, 1]")
        # An expert among the m is taken only if its router probability is at least this (None: DEFAULT_SHARE / E).
        self.min_prob = min_prob
        layers = sorted(routers)
        self.hops: dict[int, list[_Hop]] = {}
        for i, src in enumerate(layers):
            hops = []
            for j in self.distances:
                if i + j >= len(layers) or (targets is not None and layers[i + j] not in targets):
                    continue
                t = layers[i + j]
                w_s = routers[src].norm.weight.astype(mx.float32)
                w_t = routers[t].norm.weight.astype(mx.float32)
                scale = mx.where(mx.abs(w_s) > 0, w_t / mx.where(mx.abs(w_s) > 0, w_s, 1.0), 0.0)
                mx.eval(scale)
                hops.append(_Hop(t, j, scale, routers[t].gate))
            if hops:
                self.hops[src] = hops

    def forecast(self, layer: int, x: mx.array) -> list[tuple[_Hop, mx.array]]:
        """Lazy (hop, top-m expert ids (T, m), -1 where below min_prob) for every target forecast from
        `layer`'s input x (..., D)."""
        out = []
        for hop, logits in self.logits(layer, x):
            m = min(self.per_token, logits.shape[-1])
            top = mx.argpartition(-logits, m - 1, axis=-1)[:, :m]
            tau = self.threshold(logits.shape[-1])
            if tau > 0:
                p = mx.take_along_axis(mx.softmax(logits, axis=-1), top, axis=-1)
                top = mx.where(p >= tau, top.astype(mx.int32), -1)
            out.append((hop, top))
        return out

    def threshold(self, n_experts: int) -> float:
        """The minimum router probability of a taken expert for a router over `n_experts`."""
        return DEFAULT_SHARE / n_experts if self.min_prob is None else self.min_prob

    def logits(self, layer: int, x: mx.array) -> list[tuple[_Hop, mx.array]]:
        """Lazy (hop, router logits (T, E) of the target) for every target forecast from `layer`."""
        xf = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        return [(hop, hop.gate((xf * hop.scale).astype(x.dtype)).astype(mx.float32)) for hop in self.hops.get(layer, [])]

    @staticmethod
    def experts(top: mx.array) -> np.ndarray:
        """The distinct experts of an evaluated forecast (T, m)."""
        u = np.unique(np.array(top))
        return u[u >= 0]
