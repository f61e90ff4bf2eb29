"""Frequency oracles: how far any frequency-ranking eviction policy can get, with foresight.

Belady's MIN evicts the expert used farthest in the future. An online policy (LRU, LFU,
dlfu) can only rank experts by their past. These what-ifs rank by the *future* frequency
instead, which no online policy has either, to show how much foresight a policy would need
to approach Belady on a trace:
- horizon None: each expert's count over its whole passage (the best static popularity);
- horizon H: its count in the next H tokens (a local-future oracle; larger H knows more).
On a miss the resident expert (not needed by the current token) with the lowest count is
evicted, the least recently used among equals.

Invariants: window 1 (one token per call); misses >= belady()'s on the same trace (MIN is optimal);
a passage starts with an empty cache, as in replay() and belady().
"""

from __future__ import annotations

import numpy as np


def future_frequency_misses(seqs: list[np.ndarray], slots: int, horizon: int | None = None) -> int:
    """Misses of the future-frequency oracle on one layer's sequences (each (tokens, k))."""
    if horizon is not None and horizon < 1:
        raise ValueError(f"horizon {horizon}; expected at least 1 token, or None for the whole passage")
    misses = 0
    for s in seqs:
        s = np.asarray(s)
        n = int(s.max()) + 1 if s.size else 0
        whole = np.bincount(s.reshape(-1), minlength=n) if horizon is None else None
        last: dict[int, int] = {}  # resident expert -> token of its last use
        for t in range(len(s)):
            need = set(s[t].tolist())
            if len(need) > slots:
                raise ValueError(f"a token needs {len(need)} experts but the cache has {slots} slots")
            count = whole if horizon is None else np.bincount(s[t + 1 : t + 1 + horizon].reshape(-1), minlength=n)
            for e in need:
                if e not in last:
                    misses += 1
                    if len(last) >= slots:
                        victim = min((r for r in last if r not in need), key=lambda r: (count[r], last[r]))
                        del last[victim]
                last[e] = t
    return misses
