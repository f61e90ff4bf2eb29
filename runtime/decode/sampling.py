"""Acceptance rules of speculative decoding.

Greedy: accept draft tokens while they equal the target's argmax; the first
mismatch (or the position after the last draft) contributes the target's argmax.
The output is exactly greedy decoding of the target.

Sampling (Leviathan et al. / Chen et al.): draft token d_i drawn from q_i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection
the token is drawn from the residual norm(max(p_i - q_i, 0)); if every draft is
accepted a bonus token is drawn from p_{K+1}. Each emitted token is then
distributed exactly as the target's p, whatever q is. p and q are the
distributions mlx-lm's `make_sampler` draws from (its top-p, min-p and top-k
filters on the log-probabilities, then the temperature), so speculative sampling
keeps exactly the target's sampler, filters included.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class Sampling:
    """A target's sampler settings, as mlx-lm's make_sampler takes them (temp 0: greedy)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self):
        if self.temp < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"--temp {self.temp} / --top-p {self.top_p}; expected temp >= 0 and 0 < top_p <= 1")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError(f"--top-k {self.top_k} / --min-p {self.min_p}; expected top_k >= 0 and 0 <= min_p <= 1")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def probabilities(self, logits: mx.array) -> mx.array:
        return probabilities(logits, self.temp, self.top_p, self.top_k, self.min_p)


def probabilities(logits: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> mx.array:
    """The distribution (..., V) mlx-lm's make_sampler(temp, top_p, min_p, top_k) draws from for `logits`.

    Same filters, same order, on the temperature-1 log-probabilities (mlx-lm's own functions), then
    the temperature: a filter applied after the temperature would keep a different set of tokens."""
    if temp <= 0:
        raise ValueError("probabilities() is for sampling; temperature must be > 0")
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return mx.softmax(logprobs * (1.0 / temp), axis=-1)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a probability vector (float64 cumulative search, exact up to rounding)."""
    c = np.cumsum(p, dtype=np.float64)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def accept_greedy(draft: list[int], target_argmax: np.ndarray) -> tuple[int, int]:
    """(number of draft tokens accepted, the token the target contributes)."""
    n = 0
    while n < len(draft) and draft[n] == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def accept_sampled(draft: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """Rejection sampling. q: (K, Vq) drafter distributions, p: (K+1, Vp) target distributions.

    Vq and Vp may differ (padded embedding tables): the shorter is padded with zeros, so
    every token keeps its target probability (a draft beyond Vp has p = 0: rejected)."""
    if q.shape[-1] != p.shape[-1]:
        v = max(q.shape[-1], p.shape[-1])
        q = np.pad(q, ((0, 0), (0, v - q.shape[-1])))
        p = np.pad(p, ((0, 0), (0, v - p.shape[-1])))
    for i, d in enumerate(draft):
        if rng.random() * q[i, d] < p[i, d]:  # u < p/q without dividing by a tiny q
            continue
        residual = np.maximum(p[i].astype(np.float64) - q[i], 0.0)
        total = residual.sum()
        return i, sample(residual / total if total > 0 else p[i], rng)
    return len(draft), sample(p[len(draft)], rng)
