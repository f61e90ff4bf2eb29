"""Replaying a routing trace with a recorded forecast: demand misses, prefetch reads used and wasted.

A prefetcher that queues a layer's forecast experts before the layer's call, protected from
eviction until that call (as the router lookahead once did live; docs/flags.md), is replayed
here. Per call of `window` tokens this replay does so with the live cache's SlotTable:
1. every forecast expert not resident gets a slot as a prefetch (reserve(prefetch=True),
   evicting by the policy) and is read; resident ones are only protected;
2. the protection ends (the layer's call begins);
3. the call's experts are requested: resident ones are hits (a prefetched one counts as
   a prefetch used), absent ones are demand misses.
It assumes every prefetch completes before its layer's call (with real reads one that
does not is promoted and waited for: a stall, but still not a demand read).
admit="free" is the what-if of prefetching only into free slots (never evicting for a
speculative read): a forecast expert is read only if the layer has a free slot.

Invariants: reads = demand misses + prefetch reads; a prefetch read is used (a hit on
it before its eviction), wasted (evicted unused) or still resident unused at the end;
with empty forecasts the counts equal replay()'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.cache import SlotTable
from storage import ExpertKey


@dataclass(frozen=True)
class PrefetchReplayResult:
    hits: int  # unique experts per call found resident (prefetched or not)
    misses: int  # demand misses: read while the call waited
    prefetch_reads: int  # experts read because a forecast named them
    prefetch_used: int  # of those, used by a call before being evicted
    prefetch_wasted: int  # of those, evicted before any use
    tokens: int

    @property
    def reads(self) -> int:
        return self.misses + self.prefetch_reads

    def per_token(self, n: int) -> float:
        return n / self.tokens if self.tokens else 0.0


def replay_prefetch(seqs: list[np.ndarray], forecasts: list[np.ndarray] | None, n_experts: int, slots: int,
                    policy: str, window: int = 1, admit: str = "any") -> PrefetchReplayResult:
    """One layer: seqs (tokens, k) actual expert ids per sequence; forecasts (tokens, m) forecast ids
    for the same tokens (-1: none; None: no forecast at all). admit: "any" (evict by the policy) or
    "free" (free slots only)."""
    if admit not in ("any", "free"):
        raise ValueError(f"admit {admit!r}; expected 'any' or 'free'")
    table = SlotTable({0: n_experts}, {0: slots}, policy)
    ls = table.layers[0]
    reads = tokens = 0
    for i, s in enumerate(seqs):
        tokens += len(s)
        f = forecasts[i] if forecasts is not None else None
        for a in range(0, len(s), window):
            named = np.unique(f[a : a + window]) if f is not None else np.zeros(0, np.int64)
            named = named[named >= 0]
            protected = [int(ls.expert_to_slot[e]) for e in named if ls.expert_to_slot[e] >= 0]
            table.pin(0, protected)  # resident forecast experts first: a prefetch must not evict them
            for e in named.tolist():
                if ls.expert_to_slot[e] >= 0:
                    continue
                if admit == "free" and not (ls.state[: ls.usable] == 0).any():
                    continue
                slot = table.reserve(ExpertKey(0, e), prefetch=True)
                if slot is None:
                    continue  # every slot protected: the live cache skips it too
                table.commit(ExpertKey(0, e))
                reads += 1
                table.pin(0, [slot])
                protected.append(slot)
            table.unpin(0, protected)
            _, absent, pinned = table.request(0, np.unique(s[a : a + window]))
            for e in absent:
                table.commit(ExpertKey(0, e))
            table.unpin(0, pinned)
    st = ls.stats
    return PrefetchReplayResult(st.hits, st.misses, reads, st.prefetch_hits, st.prefetch_wasted, tokens)
