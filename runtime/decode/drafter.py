"""The drafter: a small mlx-lm model proposing K tokens per round, with hidden-state taps.

Protocol (a seam for other drafters, e.g. an MTP head): prefill(ids) feeds the
context; propose(k, ...) consumes the pending tokens and returns K proposals plus
the taps of the verify window's tokens it fed (all but d_K); settle(n_accepted, next_token) makes
the drafter's state match the accepted prefix and queues next_token.

Proposals are pipelined as mlx-lm's own draft loop is: step i+1 is built on step i's lazy
token and queued before the host reads anything of step i, so the drafter's graph building and
the forecast's host work (on_step for step i, while step i+1 computes) overlap its compute; the
tokens (and a sampled round's distributions q) are read back once, at the end of the round. A
greedy token is the argmax; a sampled one is drawn on the device by inverting q's cumulative sum
at a uniform the host draws from the decoder's generator, one per step in step order (as a draw
on the host would), so a seed still fixes the round.

Invariants: after settle(), the drafter's cache holds exactly the accepted context
except the pending tokens, which propose() feeds first. on_step(taps) sees taps whose first
`taps.ready` tokens (all, when None) have their states evaluated or queued ahead of anything
still being built; the proposals and taps are the same as a step-by-step loop's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from predictor.base import DraftTaps
from runtime.decode.sampling import Sampling
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


def draw(cumulative: mx.array, u: float) -> mx.array:
    """The token a uniform u in [0, 1) selects from a distribution given by its cumulative sum (V,), on the device:
    the first index whose cumulative probability exceeds u times the total (runtime/decode/sampling.py's sample())."""
    return mx.minimum((cumulative <= u * cumulative[-1]).astype(mx.uint32).sum(), cumulative.shape[-1] - 1)


def drawn_from(cumulative: np.ndarray) -> np.ndarray:
    """The distributions (..., V) that draw() samples exactly: the steps of the (float32) cumulative sums it
    inverted, normalized. Acceptance must use these: rejection sampling keeps the target's p for any q, provided
    the drafts were drawn from that q (a float32 cumulative sum moves each step by ~1e-7)."""
    c = cumulative.astype(np.float64)
    return np.diff(c, axis=-1, prepend=0.0) / c[..., -1:]


class ModelDrafter:
    def __init__(self, model, *, taps: bool = True):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.taps = HiddenTaps(model) if taps else None
        self.pending: list[int] = []
        self._k = 0

    def prefill(self, ids: list[int]) -> None:
        """Feed all of `ids` but the last, which becomes the pending input of round one."""
        if len(ids) > 1:
            self.model(mx.array(ids[:-1])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.pending = [ids[-1]]

    def _step(self, tokens: list[int] | mx.array, taps: DraftTaps) -> mx.array:
        """Build one drafter forward over `tokens` (ids, or a lazy (1, n) array) and record its taps."""
        if self.taps:
            self.taps.enabled = True
        inputs = tokens if isinstance(tokens, mx.array) else mx.array(tokens)[None]
        logits = self.model(inputs, cache=self.cache)[0, -1]
        if self.taps:
            self.taps.enabled = False
            rec = self.taps.take()
            taps.residual.append({l: r["h"][0, -1] for l, r in rec.items()})
            taps.attention.append({l: r["h"][0, -1] - r["x"][0, -1] for l, r in rec.items()})
        return logits

    def propose(self, k, *, sampling=None, rng=None, on_step=None, on_taps=None) -> DraftResult:
        """K proposals: the argmax when `sampling` is None or greedy, else drawn from the drafter's distribution
        under the target's sampler settings (q; any q keeps the target's p), with uniforms from `rng`.
        on_step(taps) once per step, after the next step is queued too (taps.ready names the steps it may read);
        on_taps(taps), right after a step is built, may return lazy arrays built on its taps (a forecast's): they
        are evaluated with the step's token."""
        greedy = sampling is None or sampling.greedy
        if not greedy and rng is None:
            raise ValueError("a sampled proposal needs the decoder's random generator (rng)")
        taps, best, qs = DraftTaps(), [], []
        feed: list[int] | mx.array = self.pending
        if len(feed) > 1:  # catching up (a stretch's tokens): all but the last through the KV only, their logits unbuilt
            self.model(mx.array(feed[:-1])[None], cache=self.cache)  # (an output layer of 150K rows costs per position)
            feed = feed[-1:]
        for i in range(k):  # pipelined (the module docstring): one read of the round's tokens, at its end
            logits = self._step(feed, taps)
            extra = on_taps(taps) if on_taps else None
            if greedy:
                best.append(mx.argmax(logits))
            else:
                qs.append(mx.cumsum(sampling.probabilities(logits), axis=-1))  # float32: probabilities() casts
                best.append(draw(qs[-1], rng.random()))
            mx.async_eval(best[-1], [] if extra is None else extra)
            if on_step and i:
                taps.ready = i  # step i is queued behind the states on_step may read
                on_step(taps)
            feed = best[-1].reshape(1, 1)
        taps.ready = None
        if on_step:
            on_step(taps)
        tokens = mx.stack(best).tolist()  # the round's one read of its tokens
        self._k = k
        self._last_draft = tokens[-1]
        self.pending = []
        return DraftResult(tokens, drawn_from(np.array(mx.stack(qs))) if qs else None, taps)

    def skip(self, token: int) -> None:
        """A round without drafting (K = 0) emitted `token`: queue it; the next propose()
        feeds every queued token in one forward."""
        self.pending.append(token)

    def settle(self, n_accepted: int, next_token: int) -> None:
        # The cache holds the window up to d_{K-1} (d_K was never fed); keep up to d_n.
        held = self._k - 1
        if n_accepted < held:
            for c in self.cache:
                c.trim(held - n_accepted)
            self.pending = [next_token]
        elif n_accepted == held:
            self.pending = [next_token]
        else:  # every draft accepted: d_K was never fed
            self.pending = [self._last_draft, next_token]
