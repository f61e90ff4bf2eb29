"""Replaying routing traces through cache policies, and the offline optimum.

The replay drives the very SlotTable (and policy objects) the live ExpertCache
uses, one call per window of `window` tokens (1 = plain decode, K+1 = verify),
so its hit and miss counts equal the live cache's on the same call sequence.

- belady(): Belady's MIN adapted to windows: every expert of the current window
  must be resident at once; on a miss, evict the resident expert (not needed by
  this window) whose next use is farthest away. No online policy can miss less.
- forecast-aware: before each window the experts a forecaster would name are
  pinned (the live cache's prefetch protection); here the forecast is simulated
  from the trace itself with a given recall, as a what-if for predictor quality.
- Per-layer slot split: a miss curve per layer (misses vs slots) and a greedy
  allocation of a total slot count by largest marginal gain.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from runtime.cache.slot_table import SlotTable
from storage import ExpertKey


@dataclass(frozen=True)
class ReplayResult:
    hits: int  # unique experts per window found resident
    misses: int  # unique experts per window read
    windows: int  # calls replayed
    tokens: int  # tokens replayed

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 1.0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0


def windows_of(seqs: list[np.ndarray], window: int) -> list[np.ndarray]:
    """Unique expert ids of consecutive `window`-token calls, sequence by sequence."""
    out = []
    for s in seqs:
        for i in range(0, len(s), window):
            out.append(np.unique(s[i : i + window]))
    return out


def replay(seqs: list[np.ndarray], n_experts: int, slots: int, policy: str = "lru", window: int = 1,
           forecast_recall: float | None = None, seed: int = 0) -> ReplayResult:
    """Replay one layer's sequences (each (tokens, k)) through a live-cache SlotTable."""
    table = SlotTable({0: n_experts}, {0: slots}, policy)
    ws = windows_of(seqs, window)
    rng = np.random.default_rng(seed)
    ls = table.layers[0]
    for i, experts in enumerate(ws):
        protected = []
        if forecast_recall is not None and i + 1 < len(ws):
            # The next window's experts that a forecaster with this recall would name, if resident;
            # never more than leaves room for this window, so forecasts never block a demand load.
            nxt = ws[i + 1]
            named = nxt[rng.random(len(nxt)) < forecast_recall]
            protected = [int(ls.expert_to_slot[e]) for e in named if ls.expert_to_slot[e] >= 0 and e not in experts]
            protected = protected[: max(0, slots - len(experts))]
            table.pin(0, protected)
        _, absent, pinned = table.request(0, experts)
        for e in absent:
            table.commit(ExpertKey(0, e))
        table.unpin(0, pinned + protected)
    st = ls.stats
    return ReplayResult(st.hits, st.misses, len(ws), sum(len(s) for s in seqs))


def belady(seqs: list[np.ndarray], slots: int, window: int = 1) -> ReplayResult:
    """Belady's MIN on windows: the fewest misses any policy can achieve with `slots`."""
    ws = windows_of(seqs, window)
    uses: dict[int, list[int]] = {}
    for i, experts in enumerate(ws):
        for e in experts.tolist():
            uses.setdefault(e, []).append(i)

    def next_use(e: int, i: int) -> float:
        u = uses[e]
        j = bisect.bisect_right(u, i)
        return u[j] if j < len(u) else float("inf")

    resident: set[int] = set()
    hits = misses = 0
    for i, experts in enumerate(ws):
        need = set(experts.tolist())
        if len(need) > slots:
            raise ValueError(f"a window needs {len(need)} experts but the cache has {slots} slots")
        for e in need:
            if e in resident:
                hits += 1
                continue
            misses += 1
            if len(resident) >= slots:
                victim = max((r for r in resident if r not in need), key=lambda r: next_use(r, i))
                resident.remove(victim)
            resident.add(e)
    return ReplayResult(hits, misses, len(ws), sum(len(s) for s in seqs))


def miss_curve(seqs: list[np.ndarray], n_experts: int, slot_counts: list[int], policy: str = "lru",
               window: int = 1) -> dict[int, int]:
    return {s: replay(seqs, n_experts, s, policy, window).misses for s in slot_counts}


def allocate_slots(curves: dict[int, dict[int, int]], total: int, minimum: int) -> dict[int, int]:
    """Split `total` slots over layers to minimise summed misses, given each layer's miss curve
    (slots -> misses, defined for every count from `minimum` up); at least `minimum` per layer."""
    alloc = {l: minimum for l in curves}
    left = total - minimum * len(curves)
    if left < 0:
        raise ValueError(f"{total} slots cannot give {len(curves)} layers {minimum} each")
    for _ in range(left):
        def gain(l):
            s = alloc[l]
            c = curves[l]
            return c[s] - c[s + 1] if s + 1 in c else -1

        best = max(curves, key=gain)
        if gain(best) < 0:
            break
        alloc[best] += 1
    return alloc
