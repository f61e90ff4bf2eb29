"""PassForecasts: the router lookahead inside a one-sync device pass (runtime/decode/device_pass.py).

Shapes: T = tokens of the forward, m = experts the lookahead takes per token.

In a device pass every layer looks its experts up on the device and the whole forward is read
back with one host sync, so there is no moment between layers to queue a prefetch. A lookahead
attached with in_pass=True (OffloadedModel.set_lookahead) is folded in anyway: it costs no host
sync, is scored, and can serve at repairs. When layer l finds an expert absent, its own routing is right (its
input was), but every later layer routed from a residual that used a wrong expert output: their
flagged experts may not be the ones they route to once l is repaired, and then a second repair
follows. A forecast of a later layer made from the MoE input of a layer at or before l (an input
that was right) is evaluated lazily in the same graph and read back with the pass's one sync; if
its hook's `in_repairs` is set, a repair reads those forecast experts together with the flagged
ones, in the same parallel batch. Off by default: on the embedded pair at 25% it read 5% more
and did not reduce repairs (the residual drift after a wrong expert output changes the routing of
every later layer, and any one miss among them repairs again; docs/read-less.md).

The forecasts are also scored (recall and precision by distance, LookaheadPrefetch.finish with
queue=False) against the accepted forward's routing, in the pass's deferred bookkeeping.

Invariants: no host sync of its own (arrays() are evaluated by the pass's sync); only forecasts
made from layers at or before the first layer that missed are used; a layer's needs never exceed
its usable slots (forecast experts are left out first); forecasts only change what is read when,
never what is computed.
"""

from __future__ import annotations

import numpy as np


class PassForecasts:
    def __init__(self, index: dict[int, int]):
        self.index = index  # MoE layer -> decoder layer index (the order layers run in)
        self._lazy: list = []  # (source layer, hook, [(hop, lazy top (T, m))]) recorded by this build
        self._host: dict[int, tuple] = {}  # source layer -> (hook, [(hop, top (T, m) numpy)]) of the current forward
        self.repair_reads = 0  # forecast experts added to repair reads (read or already resident)

    def reset(self) -> None:
        """A new forward begins."""
        self._lazy, self._host = [], {}

    def record(self, layer: int, hook, forecast: list) -> None:
        """Layer `layer`'s lazy forecast of later layers (from its lookahead hook's start())."""
        if forecast:
            self._lazy.append((layer, hook, forecast))

    def arrays(self) -> list:
        """The lazy forecast arrays of this build: evaluate them with the pass's sync."""
        return [top for _, _, f in self._lazy for _, top in f]

    def after_sync(self) -> None:
        """Keep the evaluated forecasts of this build (a rebuild re-records the layers it recomputes)."""
        for layer, hook, f in self._lazy:
            self._host[layer] = (hook, [(hop, np.array(top)) for hop, top in f])
        self._lazy = []

    def extend(self, needs: dict[int, np.ndarray], first_missing: int, usable: dict[int, int]) -> dict[int, np.ndarray]:
        """`needs` (layer -> unique expert ids to read) plus the forecast experts of layers after the first
        missing one (decoder index `first_missing`), forecast from layers at or before it."""
        out = dict(needs)
        for source, (hook, f) in self._host.items():
            if self.index[source] > first_missing or not getattr(hook, "in_repairs", False):
                continue  # its input came after a wrong expert output, or its hook does not ask for it
            for hop, top in f:
                if self.index[hop.target] <= first_missing:
                    continue
                add = hook.lookahead.experts(top)
                have = out.get(hop.target, np.zeros(0, np.int64))
                both = np.union1d(have, add)
                if len(both) <= usable[hop.target]:
                    self.repair_reads += len(both) - len(have)
                    out[hop.target] = both
        return out

    def drop_from(self, first: int) -> None:
        """A repair recomputes the layers from decoder index `first`: their forecasts are recorded again."""
        self._host = {l: v for l, v in self._host.items() if self.index[l] < first}

    def take(self) -> dict[int, tuple]:
        """The accepted forward's forecasts, for score(); the next forward starts empty."""
        host, self._host = self._host, {}
        return host

    def score(self, forecasts: dict[int, tuple], routing: dict[int, np.ndarray], hooks: dict) -> None:
        """Score each layer's earlier forecasts against its routing and register its own, in layer order."""
        for layer in sorted(routing, key=self.index.get):
            hook = hooks.get(layer)
            if hook is not None:
                hook.finish(layer, forecasts.get(layer, (None, []))[1], routing[layer], queue=False)
