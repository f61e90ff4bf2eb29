"""Goodness-of-fit helpers for the sampling tests: chi-square critical values and the
randomized probability integral transform.

chi2_critical(df, alpha) works for every df >= 1 (scipy when installed, else the
Wilson-Hilferty approximation, within 1% of the exact value for df >= 3 at alpha=0.001,
and conservative (larger) for df 1-2). pit() maps a token drawn from p to a value that is
Uniform(0, 1) exactly when the token really was drawn from p, so draws from different
contexts (different p) can be pooled in one uniformity test.
"""

from __future__ import annotations

import math

import numpy as np


def chi2_critical(df: int, alpha: float = 0.001) -> float:
    if df < 1:
        raise ValueError(f"chi-square with {df} degrees of freedom; need at least 2 buckets")
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1 - alpha, df))
    except ImportError:
        z = _normal_quantile(1 - alpha)
        wh = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        return wh * (1.1 if df <= 2 else 1.0)


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):  # bisection on the normal CDF
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi2_stat(observed: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    if (observed[~keep] > 0).any():
        return math.inf  # a draw the distribution gives probability 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def pooled_counts(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0):
    """Merge buckets with expected counts below `min_expected` into one tail bucket."""
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # a tail too small to test on its own: fold it into the smallest bucket
        obs, exp = obs[:-1].copy(), exp[:-1].copy()
        if len(obs):
            obs[np.argmin(exp)] += observed[~big].sum()
            exp[np.argmin(exp)] += expected[~big].sum()
    return obs, exp


def pit(p: np.ndarray, token: int, rng: np.random.Generator) -> float:
    """Randomized PIT of `token` under p (tokens ordered by descending probability)."""
    order = np.argsort(-p, kind="stable")
    rank = int(np.flatnonzero(order == token)[0])
    below = float(p[order[:rank]].sum())
    return min(1.0, below + rng.random() * float(p[token]))


def uniformity_chi2(u: np.ndarray, bins: int = 10) -> tuple[float, float]:
    """(chi-square statistic, critical value at alpha=0.001) of `u` against Uniform(0, 1)."""
    counts = np.histogram(np.clip(u, 0, 1), bins=bins, range=(0, 1))[0]
    return chi2_stat(counts, np.full(bins, len(u) / bins)), chi2_critical(bins - 1)
