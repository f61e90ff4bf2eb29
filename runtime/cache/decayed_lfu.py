"""DecayedLFUPolicy ("dlfu"): frequency with exponential aging, remembered per expert.

Each expert has a score: every use adds 1, and all scores decay by half every
`half_life` uses of the layer (aging, so experts popular long ago give way). The
score is kept per expert, not per slot, so an expert evicted and read again comes
back with its history (plain in-cache LFU restarts it at zero, which is why it
thrashes between a few popular experts at small caches). The victim is the
resident expert with the lowest score; ties go to the least recently used.

Prefetch awareness: an expert a forecast brought in gets no use counted until a
call really uses it, and it ranks as least recent until then, so a prefetch that
was not used (once its pin is gone) is the first to go among equal scores and
never displaces an expert by a use it did not have.

Guard against routing without frequency structure: the policy also keeps a shadow
LRU over expert ids (what an LRU cache of the same size would hold, uses only) and
decayed counts (half-life 8 uses per slot) of its own demand misses and the
shadow's. While the shadow LRU has been missing under 0.9x as much, the victim is
the least recently used candidate instead. Random-weight checkpoints whose greedy
text loops keep stale high scores for a half-life after each change of loop; there
plain dlfu missed more than LRU, the guard takes most of that back, while the
embedded pair's trace keeps its win (bench/results/policy_no_locality.txt; the
0.9 margin keeps dlfu when the two tie, or it would stay LRU-like for good).

Invariants: scores are only changed by on_access (uses) and time; victim() picks
among the candidates it is given and mutates nothing. Decay is applied lazily:
score(e) = count[e] * 2 ** -((tick - stamp[e]) / half_life), exact in floating point
up to rounding, and comparisons never depend on when the decay was applied.
"""

from __future__ import annotations

import math
from collections import OrderedDict


class DecayedLFUPolicy:
    name = "dlfu"

    def __init__(self, n_slots: int, half_life: int | None = None):
        # 32 uses per slot: about 128 decode tokens of a top-4, 16-slot layer (chosen by replay;
        # half-lives from 16 to 256 uses per slot are within 1% of each other on the embedded trace).
        self.half_life = half_life or 32 * n_slots
        self._rate = math.log(2) / self.half_life
        self._tick = 0
        self._expert = [-1] * n_slots  # slot -> expert it holds (as the SlotTable last told us)
        self._last = [0] * n_slots  # slot -> tick of its last use (0: never used since insert)
        self._count: dict[int, float] = {}  # expert -> score at its stamp
        self._stamp: dict[int, int] = {}  # expert -> tick at which its count was last updated
        self._n_slots = n_slots
        self._ghost: OrderedDict[int, None] = OrderedDict()  # shadow LRU: the n_slots experts used most recently
        self._own_misses = 0.0  # decayed demand misses of this cache ...
        self._lru_misses = 0.0  # ... and of the shadow LRU, both at tick _miss_stamp
        self._miss_stamp = 0
        self._miss_rate = math.log(2) / (8 * n_slots)

    def score(self, expert: int) -> float:
        c = self._count.get(expert)
        return 0.0 if c is None else c * math.exp(-self._rate * (self._tick - self._stamp[expert]))

    def _decay_misses(self) -> None:
        f = math.exp(-self._miss_rate * (self._tick - self._miss_stamp))
        self._own_misses *= f
        self._lru_misses *= f
        self._miss_stamp = self._tick

    def _shadow_use(self, e: int) -> None:
        g = self._ghost
        if e in g:
            g.move_to_end(e)
            return
        self._decay_misses()
        self._lru_misses += 1.0
        g[e] = None
        if len(g) > self._n_slots:
            g.popitem(last=False)

    def on_insert(self, slot: int, expert: int = -1, prefetch: bool = False) -> None:
        self._expert[slot] = expert
        self._last[slot] = 0
        if not prefetch:  # a demand miss of this cache
            self._decay_misses()
            self._own_misses += 1.0
            self.on_access(slot)

    def on_access(self, slot: int) -> None:
        self._tick += 1
        e = self._expert[slot]
        self._count[e] = self.score(e) + 1.0
        self._stamp[e] = self._tick
        self._last[slot] = self._tick
        self._shadow_use(e)

    def on_access_many(self, slots: list[int]) -> None:
        """on_access(slot) for each slot in order, with the same arithmetic (the decoder books a whole
        forward's uses at once)."""
        tick, rate, exp = self._tick, self._rate, math.exp
        count, stamp, expert, last, ghost = self._count, self._stamp, self._expert, self._last, self._ghost
        for slot in slots:
            tick += 1
            e = expert[slot]
            c = count.get(e)
            count[e] = (0.0 if c is None else c * exp(-rate * (tick - stamp[e]))) + 1.0
            stamp[e] = tick
            last[slot] = tick
            if e in ghost:
                ghost.move_to_end(e)
            else:
                self._tick = tick
                self._shadow_use(e)
        self._tick = tick

    def victim(self, candidates: list[int]) -> int:
        """The candidate whose expert has the lowest score, ties to the least recent: score()'s arithmetic, inlined
        (a read's victim search was ~1.5 us per candidate through score() and a key lambda); the least recent
        candidate while the shadow LRU has been missing under 0.9x as much (both counts decay alike: no decay
        needed to compare)."""
        if self._lru_misses < 0.9 * self._own_misses:
            return min(candidates, key=self._last.__getitem__)
        tick, rate, exp = self._tick, self._rate, math.exp
        count, stamp, expert, last = self._count, self._stamp, self._expert, self._last
        best, best_key = candidates[0], None
        for s in candidates:
            e = expert[s]
            c = count.get(e)
            key = (0.0 if c is None else c * exp(-rate * (tick - stamp[e])), last[s])
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best
