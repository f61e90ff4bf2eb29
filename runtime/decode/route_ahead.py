"""RouteAhead: a routed forward's route syncs also forecast the next layers and prefetch them.

Shapes: H = layers forecast from one source layer, T = tokens of the forward, D = hidden width, E = experts.

A routed forward (runtime/decode/route_sync.py) syncs every MoE layer's lookup codes before its experts
run, and reads what is absent there: with slow reads (an SSD, ~0.3-0.6 ms per expert on a Mac) each layer
that misses stalls for a whole read while nothing computes. The router lookahead (predictor/lookahead.py:
layer l's MoE input rescaled by the norms, through layer t's router) forecasts the H = len(DISTANCES) next
layers from layer l's input, in the graph layer l builds anyway, and is read back with layer l's codes:
no host sync of its own. At that sync every graph built so far has been evaluated, so the pass may let go
of its hold for a moment: the forecast experts with no slot in layers l + 1 .. l + H are queued as
prefetches (below every demand read; protected until the forward is booked), after layer l's own reads,
and they read while layer l's experts and the next layers' attention compute. A later layer then finds
them resident, or waits at its own route sync for the rest of a read already under way.

The forecast is built as a few batched ops per source layer whatever H is (its targets' gates stacked,
dequantized to float32, once): on a CPU each op's dispatch costs more than its arithmetic. Each token
takes its top-k experts per target whose router probability is at least predictor/lookahead.py's
DEFAULT_SHARE / E (a wasted read also takes a slot from a useful expert). A layer whose targets' routers
are not plain (quantized) linears, or whose norms the lookahead cannot rescale, forecasts nothing.

It can pay only where reads are slow against those ops and the prefetch reads' own work:
OffloadConfig.route_ahead "on", or "auto", which switches it on while the loader's mean time per expert
read (storage/loader.py's read_ms over its reads) is at least MIN_READ_MS (SSD reads, or emulated
latency; page-cache reads here take ~0.05-0.2 ms, but a loaded machine stretches them). Off by default:
on this CPU it measured within the noise with +1/+2 ms per read (bench/results/route_ahead.txt: fewer
demand reads and less waiting, more CPU for the extra reads on the same two cores).

Invariants: a forecast uses only its source layer's own MoE input and names later layers only; it is
queued at that layer's route sync (everything built earlier is evaluated, no later layer is built), with
the hold released exactly around the queueing; forecasts change what is read when, never what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from predictor.lookahead import DEFAULT_SHARE
from storage import ExpertKey

MIN_READ_MS = 0.25  # "auto": mean ms per expert read at or above which route syncs prefetch ahead
DISTANCES = (1, 2)  # MoE layers ahead forecast from each routed layer
ROUTE_AHEAD_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class _Stack:
    targets: list[int]  # the layers forecast, nearest first
    scale: mx.array  # (H, 1, D) w_target / w_source: the target's norm applied to the source's input
    gate_w: mx.array  # (H, D, E) float32
    gate_b: mx.array | None  # (H, 1, E) or None


def _gate_weights(gate) -> tuple[mx.array, mx.array | None] | None:
    """((D, E) float32 weight, (E,) bias or None) of a (quantized) linear router, else None."""
    if isinstance(gate, nn.QuantizedLinear):
        w = mx.dequantize(gate.weight, gate.scales, gate.get("biases"), group_size=gate.group_size, bits=gate.bits,
                          mode=gate.mode)
    elif isinstance(gate, nn.Linear):
        w = gate.weight
    else:
        return None  # e.g. DeepSeek's scoring function: no stacked form
    b = gate.get("bias")
    return w.astype(mx.float32).T, None if b is None else b.astype(mx.float32)


class RouteAhead:
    def __init__(self, om, mode: bool | str = "auto", distances: tuple[int, ...] = DISTANCES):
        if mode not in (True, False) + ROUTE_AHEAD_MODES:
            raise ValueError(f"route_ahead={mode!r}; expected one of {', '.join(ROUTE_AHEAD_MODES)}")
        self.om = om
        self.mode = {"on": True, "off": False}.get(mode, mode)
        self.distances = distances
        self._stacks: dict[int, _Stack | None] | None = None  # source layer -> its stack, built on first use
        self.prefetched = 0  # expert reads queued by route syncs

    def active(self) -> bool:
        """Whether this forward's route syncs forecast ahead (mode, or the measured read time under "auto")."""
        if self.mode != "auto":
            return bool(self.mode)
        s = self.om.loader.stats
        reads = s.n_requests - s.n_cancelled - s.n_failed
        return reads > 0 and s.read_ms / reads >= MIN_READ_MS

    def _build(self) -> dict[int, _Stack | None]:
        from predictor.lookahead import RouterLookahead

        stacks = {}
        for src, hops in RouterLookahead(self.om.routers(), self.distances, self.om.top_k).hops.items():
            weights = [_gate_weights(h.gate) for h in hops]
            if any(w is None for w in weights) or len({w[1] is None for w in weights}) > 1:
                stacks[src] = None
                continue
            stack = _Stack([h.target for h in hops], mx.stack([h.scale for h in hops])[:, None, :],
                           mx.stack([w for w, _ in weights]),
                           None if weights[0][1] is None else mx.stack([b for _, b in weights])[:, None, :])
            mx.eval([a for a in (stack.scale, stack.gate_w, stack.gate_b) if a is not None])
            stacks[src] = stack
        return stacks

    def forecast(self, layer: int, x: mx.array) -> tuple[_Stack, mx.array] | None:
        """(stack, lazy router probabilities (H, T, E)) of the layers after `layer`, from its MoE input x, or
        None (nothing to forecast from here)."""
        if self._stacks is None:
            self._stacks = self._build()
        stack = self._stacks.get(layer)
        if stack is None:
            return None
        logits = (x.reshape(1, -1, x.shape[-1]).astype(mx.float32) * stack.scale) @ stack.gate_w
        if stack.gate_b is not None:
            logits = logits + stack.gate_b
        return stack, mx.softmax(logits, axis=-1)

    def absent_keys(self, cache, forecast: tuple[_Stack, mx.array]) -> list[ExpertKey]:
        """The evaluated forecast's experts with no slot yet (neither valid nor loading), nearer layers first."""
        stack, probs = forecast
        p = np.array(probs)  # (H, T, E), evaluated with the codes
        k = min(self.om.top_k, p.shape[-1])
        top = np.argpartition(-p, k - 1, axis=-1)[..., :k]
        keep = np.take_along_axis(p, top, axis=-1) >= DEFAULT_SHARE / p.shape[-1]
        out = []
        for target, ids, ok in zip(stack.targets, top, keep):
            slots = cache.table.layers[target].expert_to_slot
            out += [ExpertKey(target, e) for e in np.unique(ids[ok]).tolist() if slots[e] < 0]
        return out

    def queue(self, cache, keys: list[ExpertKey]) -> int:
        """Prefetch `keys` (the caller let go of the hold): protected until the forward is booked. Returns how
        many were queued (a layer whose slots are all busy takes none)."""
        before = cache.loader.stats.n_prefetch
        cache.prefetch(keys, round_id=None)
        queued = cache.loader.stats.n_prefetch - before
        self.prefetched += queued
        return queued
