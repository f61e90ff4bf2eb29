"""The drafter: a small mlx-lm model proposing K tokens per round, with hidden-state taps.

Protocol (a seam for other drafters, e.g. an MTP head): prefill(ids) feeds the
context; propose(k, ...) consumes the pending tokens and returns K proposals plus
the taps of the verify window's tokens it fed (all but d_K, unless feed_last also
feeds d_K within the round); settle(n_accepted, next_token) makes
the drafter's state match the accepted prefix and queues next_token.

Invariant: after settle(), the drafter's cache holds exactly the accepted context
except the pending tokens, which propose() feeds first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from predictor.base import DraftTaps
from runtime.decode.sampling import Sampling, sample
from runtime.decode.taps import HiddenTaps


@dataclass
class DraftResult:
    tokens: list[int]  # K proposed tokens
    q: np.ndarray | None  # (K, V) drafter distributions (sampling), None when greedy
    taps: DraftTaps  # hidden states of the verify window tokens the drafter saw


class Drafter(Protocol):
    def prefill(self, ids: list[int]) -> None: ...
    def propose(self, k: int, *, sampling: Sampling | None = None, rng: np.random.Generator | None = None,
                on_step: Callable[[DraftTaps], None] | None = None,
                on_taps: Callable[[DraftTaps], object] | None = None) -> DraftResult: ...
    def settle(self, n_accepted: int, next_token: int) -> None: ...
    def skip(self, token: int) -> None: ...


class ModelDrafter:
    def __init__(self, model, *, taps: bool = True, feed_last: bool = False):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.taps = HiddenTaps(model) if taps else None
        self.feed_last = feed_last  # also feed d_K within the round, so the whole verify window has taps
        self.pending: list[int] = []
        self._k = 0
        self._fed_last = False

    def prefill(self, ids: list[int]) -> None:
        """Feed all of `ids` but the last, which becomes the pending input of round one."""
        if len(ids) > 1:
            self.model(mx.array(ids[:-1])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.pending = [ids[-1]]

    def _step(self, tokens: list[int], taps: DraftTaps) -> mx.array:
        if self.taps:
            self.taps.enabled = True
        logits = self.model(mx.array(tokens)[None], cache=self.cache)[0, -1]
        if self.taps:
            self.taps.enabled = False
            rec = self.taps.take()
            taps.residual.append({l: r["h"][0, -1] for l, r in rec.items()})
            taps.attention.append({l: r["h"][0, -1] - r["x"][0, -1] for l, r in rec.items()})
        return logits

    def propose(self, k, *, sampling=None, rng=None, on_step=None, on_taps=None) -> DraftResult:
        """K proposals: the argmax when `sampling` is None or greedy, else drawn from the drafter's
        distribution under the target's sampler settings (q; any q keeps the target's p).
        on_step(taps) after each step, once its token is drawn; on_taps(taps), before that, may return lazy
        arrays built on the new taps (a forecast's): they are evaluated with the step's token, one host sync."""
        taps, tokens, qs = DraftTaps(), [], []
        feed = self.pending
        for _ in range(k):
            logits = self._step(feed, taps)
            extra = on_taps(taps) if on_taps else None
            if sampling is not None and not sampling.greedy:
                probs = sampling.probabilities(logits)
                mx.eval(probs, [] if extra is None else extra)
                q = np.array(probs, np.float64)
                token = sample(q, rng)
                qs.append(q)
            else:
                best = mx.argmax(logits)
                mx.eval(best, [] if extra is None else extra)
                token = int(best.item())
            if on_step:
                on_step(taps)
            tokens.append(token)
            feed = [token]
        self._fed_last = self.feed_last
        if self.feed_last:
            self._step(feed, taps)
            if on_step:
                on_step(taps)
        self._k = k
        self._last_draft = tokens[-1]
        self.pending = []
        return DraftResult(tokens, np.stack(qs) if qs else None, taps)

    def skip(self, token: int) -> None:
        """A round without drafting (K = 0) emitted `token`: queue it; the next propose()
        feeds every queued token in one forward."""
        self.pending.append(token)

    def settle(self, n_accepted: int, next_token: int) -> None:
        # The cache holds the window up to d_K (feed_last) or d_{K-1}; keep up to d_n.
        held = self._k if self._fed_last else self._k - 1
        if n_accepted < held:
            for c in self.cache:
                c.trim(held - n_accepted)
            self.pending = [next_token]
        elif n_accepted == held:
            self.pending = [next_token]
        else:  # every draft accepted without feed_last: d_K was never fed
            self.pending = [self._last_draft, next_token]
