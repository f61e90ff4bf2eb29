"""Acceptance rules of speculative decoding.

Greedy: accept draft tokens while they equal the target's argmax; the first
mismatch (or the position after the last draft) contributes the target's argmax.
The output is exactly greedy decoding of the target.

Sampling (Leviathan et al. / Chen et al.): draft token d_i drawn from q_i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection
the token is drawn from the residual norm(max(p_i - q_i, 0)); if every draft is
accepted a bonus token is drawn from p_{K+1}. Each emitted token is then
distributed exactly as the target's p, whatever q is. p and q are the
distributions *after* temperature and top-p, so the target keeps its sampler.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def probabilities(logits: mx.array, temp: float, top_p: float = 1.0) -> mx.array:
    """Sampling distribution (..., V) for `logits` under temperature and nucleus top-p."""
    if temp <= 0:
        raise ValueError("probabilities() is for sampling; temperature must be > 0")
    p = mx.softmax(logits.astype(mx.float32) / temp, axis=-1)
    if top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        sorted_p = mx.take_along_axis(p, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < top_p  # always keeps the top token
        inverse = mx.argsort(order, axis=-1)
        keep = mx.take_along_axis(keep_sorted, inverse, axis=-1)
        p = mx.where(keep, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


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
