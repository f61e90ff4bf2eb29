"""RouterBank: several target layers' (projection ->) RMSNorm -> gate, as a few batched MLX ops.

Forecasting runs after every draft step for every prefetched layer. Layer by layer that is
~6 small ops per layer, and on a CPU each op's dispatch costs more than its arithmetic. The
bank stacks the layers' weights once -- projection (L, D_d, D_t) and bias, norm weight
(L, D_t), gate dequantized to float32 (L, D_t, E) -- so a call is ~8 ops whatever L is.

Shapes: L = layers in the bank, T = tokens, D_d / D_t = drafter / target width, E = experts.

Invariant: probs(h) equals, up to float32 rounding, softmax(gate(norm(project(h)))) computed
layer by layer (tests compare the two); from_routers() returns None when a layer's norm or
gate is not the plain RMSNorm / (quantized) bias-free linear the bank can stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def _dense_weight(gate) -> mx.array | None:
    """(E, D) float32 weight of a bias-free Linear or QuantizedLinear gate, else None."""
    if not isinstance(gate, nn.Module) or "bias" in gate:  # a plain function (e.g. a MoEGate's scores) or a biased router
        return None
    if isinstance(gate, nn.QuantizedLinear):
        return mx.dequantize(gate.weight, gate.scales, gate.get("biases"), group_size=gate.group_size,
                             bits=gate.bits, mode=gate.mode).astype(mx.float32)
    if isinstance(gate, nn.Linear):
        return gate.weight.astype(mx.float32)
    return None


@dataclass(frozen=True)
class RouterBank:
    layers: list[int]  # target layers, in the order of the stacked weights
    proj_w: mx.array | None  # (L, D_d, D_t) or None: no projection
    proj_b: mx.array | None  # (L, 1, D_t)
    norm_w: mx.array  # (L, 1, D_t)
    eps: float
    gate_w: mx.array  # (L, D_t, E)

    @classmethod
    def from_routers(cls, routers: dict, layers: list[int], projections=None) -> "RouterBank | None":
        norms, gates, epss = [], [], set()
        for l in layers:
            r = routers[l]
            if type(r.norm) is not nn.RMSNorm:
                return None
            w = _dense_weight(r.gate)
            if w is None:
                return None
            norms.append(r.norm.weight.astype(mx.float32))
            epss.add(float(r.norm.eps))
            gates.append(w.T)
        if len(epss) != 1:
            return None
        proj_w = proj_b = None
        if projections is not None:
            mats = [projections.weights[l] for l in layers]
            proj_w = mx.array(np.stack([m[:-1] for m in mats]).astype(np.float32))
            proj_b = mx.array(np.stack([m[-1:] for m in mats]).astype(np.float32))
        bank = cls(list(layers), proj_w, proj_b, mx.stack(norms)[:, None, :], epss.pop(), mx.stack(gates))
        mx.eval([a for a in (bank.proj_w, bank.proj_b, bank.norm_w, bank.gate_w) if a is not None])
        return bank

    def probs(self, h: mx.array) -> mx.array:
        """h (L, T, D_d) -> router probabilities (L, T, E)."""
        if h.dtype != mx.float32:
            h = h.astype(mx.float32)
        if self.proj_w is not None:
            h = h @ self.proj_w + self.proj_b
        h = mx.fast.rms_norm(h, None, self.eps) * self.norm_w
        return mx.softmax(h @ self.gate_w, axis=-1)
