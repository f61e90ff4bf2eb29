"""Analysis of routing traces: temporal overlap, unique experts per window, baselines.

Pure functions of expert-id arrays (one MoE layer: a list of sequences, each
(tokens, k)); no model needed. Windows and distances never cross a sequence
boundary.

- overlap(d): mean over token pairs (t, t+d) of |E_t ∩ E_{t+d}| / k.
- Baselines: uniform routing gives k/N; independent tokens with this layer's
  popularity give sum_e p_e^2 / k, where p_e is the share of tokens using expert
  e (analytic); the shuffle control permutes token positions across the whole
  layer and measures again, which must agree with the analytic value.
- Unique experts in windows of t tokens: measured (sliding windows), independence
  sum_e 1 - (1 - p_e)^t, uniform N(1 - (1 - k/N)^t) (routing_math).
"""

from __future__ import annotations

import numpy as np

from runtime.observe.routing_math import uniform_unique_experts


def _check(seqs: list[np.ndarray]) -> int:
    if not seqs or any(s.ndim != 2 for s in seqs):
        raise ValueError("expected a non-empty list of (tokens, k) arrays")
    return seqs[0].shape[1]


def popularity(seqs: list[np.ndarray], n_experts: int) -> np.ndarray:
    """p_e: the share of tokens whose top-k includes expert e."""
    _check(seqs)
    tokens = sum(len(s) for s in seqs)
    counts = np.zeros(n_experts)
    for s in seqs:
        np.add.at(counts, s.reshape(-1), 1)
    return counts / max(1, tokens)


def _membership(s: np.ndarray, n_experts: int) -> np.ndarray:
    m = np.zeros((len(s), n_experts), bool)
    m[np.arange(len(s))[:, None], s] = True
    return m


def overlap(seqs: list[np.ndarray], d: int, n_experts: int) -> float:
    """Mean |E_t ∩ E_{t+d}| / k within sequences (nan if no pair exists)."""
    k = _check(seqs)
    if d < 1:
        raise ValueError(f"distance d={d}; expected d >= 1")
    shared, pairs = 0, 0
    for s in seqs:
        if len(s) > d:
            m = _membership(s, n_experts)
            shared += int((m[:-d] & m[d:]).sum())
            pairs += len(s) - d
    return shared / (pairs * k) if pairs else float("nan")


def independence_overlap(p: np.ndarray, k: int) -> float:
    """Expected overlap of two independent tokens routed with inclusion probabilities p."""
    return float((p**2).sum() / k)


def uniform_overlap(k: int, n_experts: int) -> float:
    return k / n_experts


def shuffled(seqs: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """The same tokens with their positions permuted across the whole layer (same lengths)."""
    allt = np.concatenate(seqs)[rng.permutation(sum(len(s) for s in seqs))]
    bounds = np.cumsum([0] + [len(s) for s in seqs])
    return [allt[a:b] for a, b in zip(bounds, bounds[1:])]


def unique_in_windows(seqs: list[np.ndarray], t: int, n_experts: int) -> float:
    """Mean distinct experts over all windows of t consecutive tokens within sequences."""
    _check(seqs)
    if t < 1:
        raise ValueError(f"window t={t}; expected t >= 1")
    total, windows = 0, 0
    for s in seqs:
        if len(s) >= t:
            m = _membership(s, n_experts).astype(np.int32)
            c = np.concatenate([np.zeros((1, n_experts), np.int32), np.cumsum(m, axis=0)])
            present = (c[t:] - c[:-t]) > 0  # (windows, experts)
            total += int(present.sum())
            windows += len(s) - t + 1
    return total / windows if windows else float("nan")


def independence_unique(p: np.ndarray, t: int) -> float:
    return float((1 - (1 - p) ** t).sum())


def verify_cost_ratios(times_s: dict[int, float]) -> dict[int, float]:
    """T(t)/T(1) from measured forward times per window size t (t=1 must be present)."""
    if 1 not in times_s or times_s[1] <= 0:
        raise ValueError("verify cost ratios need a positive time for t=1")
    return {t: v / times_s[1] for t, v in sorted(times_s.items())}


def layer_report(seqs: list[np.ndarray], n_experts: int, *, distances=range(1, 9), windows=range(1, 9),
                 rng: np.random.Generator | None = None) -> dict:
    """Every statistic above for one layer."""
    k = _check(seqs)
    rng = rng or np.random.default_rng(0)
    p = popularity(seqs, n_experts)
    shuf = shuffled(seqs, rng)
    return {
        "overlap": {d: overlap(seqs, d, n_experts) for d in distances},
        "overlap_shuffled": {d: overlap(shuf, d, n_experts) for d in distances},
        "overlap_independent": independence_overlap(p, k),
        "overlap_uniform": uniform_overlap(k, n_experts),
        "unique": {t: unique_in_windows(seqs, t, n_experts) for t in windows},
        "unique_independent": {t: independence_unique(p, t) for t in windows},
        "unique_uniform": {t: uniform_unique_experts(n_experts, k, t) for t in windows},
        "popularity_max_over_uniform": float(p.max() / (k / n_experts)),
        "unused_experts": int((p == 0).sum()),
    }
