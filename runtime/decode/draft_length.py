"""DraftLength: how many tokens the drafter proposes in each round (adaptive K, down to 0).

A drafter the target rarely accepts costs a drafter pass per proposed token and a
K+1-token verify for about one emitted token: slower than plain decoding. So K
follows acceptance, round by round:
- the first round is a probe (K = 1): nothing is known of the pair on this prompt
  yet, and a rejected probe costs one drafter step beside a plain round where a
  first round at K = k_max costs a (k_max + 1)-token window for one token (at full
  depth under a cap, ~7 s of the first token: bench/results/speculative_unaccepted_fullscale.txt);
  an accepted one goes on at K = k_max.
- after a round with K > 0: all K accepted -> K + 1 (at most k_max); none accepted
  -> K - 1; the running acceptance (an exponential average of accepted/proposed per
  round, starting from the first drafting round's own share) below `floor` -> K = 0.
  So a drafter whose rounds are rejected outright stops drafting after one or two
  rounds rather than after K of them, each a wider verify window for one token.
- K = 0 is plain decoding (one target token per round, no drafter work) for a
  stretch of `backoff` rounds, then one probe round with K = 1; a probe that is
  rejected doubles the stretch (up to max_backoff; the first probe's rejection
  starts the first stretch at `backoff`), an accepted one resets it.
  The decoder runs a stretch's rounds as plain decoding (runtime/decode/plain_stretch.py),
  plain_rounds() of them at once, and a greedy probe without a verify window.

The decoder cuts a round's K to the tokens the generation still wants minus one (the window's last
token is the target's own): drafts past the last wanted token would be read and computed for nothing.

Invariants: K is always in 0..k_max; with adaptive=False, K is k_max every round;
the choice depends only on earlier acceptance, so two runs that accept the same
drafts choose the same K (the oracle's recording run replays exactly).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    k_max: int  # --num-draft
    adaptive: bool = True
    floor: float = 0.2  # running acceptance below this: fall back to plain decoding
    weight: float = 0.3  # weight of the newest round in the running acceptance
    backoff: int = 4  # plain rounds before the next probe (doubles while probes fail)
    max_backoff: int = 64

    def __post_init__(self):
        first_probe = self.adaptive and self.k_max > 0
        self.k = 1 if first_probe else self.k_max  # the K of the next round
        self.acceptance = 1.0  # running acceptance (the first drafting round sets it)
        self.n_drafting = 0  # rounds with K > 0 recorded
        self.stretch = self.backoff  # plain rounds per fallback
        self.plain_left = 0  # plain rounds left before the probe
        self.probing = first_probe  # the next/last K=1 round is a probe
        self.history: list[list[int]] = []  # [K, rounds] runs, in order: the K of every recorded round

    def next_k(self) -> int:
        return self.k

    def plain_rounds(self) -> int:
        """With K = 0: the plain rounds before the next probe (at least 1); else 0."""
        return max(1, self.plain_left) if self.k == 0 else 0

    def record(self, k: int, n_accepted: int, cut: bool = False) -> None:
        """The round just verified proposed `k` tokens and accepted `n_accepted` of them. `cut`: the window was cut
        to the tokens the generation still wanted (fewer than next_k()): its share joins the running acceptance,
        and K stays, since a short last window says nothing about a longer one (the floor still applies)."""
        if self.history and self.history[-1][0] == k:
            self.history[-1][1] += 1
        else:
            self.history.append([k, 1])
        if not self.adaptive:
            return
        if k == 0:
            self.plain_left -= 1
            if self.plain_left <= 0:
                self.k, self.probing = 1, True
            return
        share = n_accepted / k
        self.acceptance = share if self.n_drafting == 0 else self.acceptance + self.weight * (share - self.acceptance)
        self.n_drafting += 1
        if self.probing:
            self.probing = False
            if n_accepted:  # the first round's probe goes on at k_max; a later one at 2, then up
                self.stretch, self.acceptance = self.backoff, max(self.acceptance, self.floor)
                self.k = self.k_max if self.n_drafting == 1 else min(2, self.k_max)
            else:
                if self.n_drafting > 1:  # the first round's probe starts the first stretch at `backoff`
                    self.stretch = min(2 * self.stretch, self.max_backoff)
                self.k, self.plain_left = 0, self.stretch
            return
        if not cut:
            self.k = min(k + 1, self.k_max) if n_accepted == k else k - 1 if n_accepted == 0 else k
        if self.acceptance < self.floor or self.k == 0:
            self.k, self.plain_left = 0, self.stretch
