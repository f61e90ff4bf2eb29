"""Routing math: closed-form statistics of top-k expert routing.

Pure functions, no I/O, no MLX. They answer "how many distinct experts does a window of tokens
touch", "when is a layer effectively fully activated", "what does a verify pass cost relative to
one decode step" and "how many tokens does a speculative round yield". The planner uses them to
project speculative decoding; the profiling code compares measured traces against them.

Sources (keys as in shared/reference/):
- MoESD, arXiv 2505.19645 (seed `002_*`): under i.i.d. uniform routing the expected number of
  distinct experts for t tokens is N(t) = E * (1 - (1 - k/E)^t); "almost full activation" is
  N(t) >= tau * E, reached at T_thres = ceil(log_{1-rho}(1 - tau)) with rho = k/E; average tokens
  per activated expert is rho * t / (1 - (1 - rho)^t). Speedup = accepted tokens per round over
  the drafter-to-target ratio plus the verify-to-decode ratio T(K+1)/T(1).
- Cohere's write-up (seed `000_*`): the verify cost splits into a routed-expert part (fraction f,
  scaling with unique experts) and a fixed part: T(K+1)/T(1) = (1 - f) + f * U(K+1) / k.
  Worked numbers: 29.1 uniform unique experts for 4 tokens, k=8, E=128; f=0.30 with 20.36
  measured unique experts predicts 1.46x; acceptance length 2.73 over 1.46 gives 1.87x.

Invariants: every function validates its inputs and raises ValueError naming the offending
value; results are floats except `saturation_threshold`, which is an int token count.
"""

from __future__ import annotations

import math

__all__ = [
    "uniform_unique_experts",
    "saturation_threshold",
    "tokens_per_expert",
    "expected_tokens_per_round",
    "verify_cost_ratio",
    "speculative_speedup",
    "power_law_hit_rate",
    "fit_power_law_exponent",
]


def _check_routing(n_experts: int, top_k: int) -> None:
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive int, got {n_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an int in [1, n_experts={n_experts}], got {top_k!r}")


def uniform_unique_experts(n_experts: int, top_k: int, n_tokens: float) -> float:
    """Expected distinct experts touched by `n_tokens` tokens routed i.i.d. uniformly (MoESD N(t)).

    Each token picks `top_k` of `n_experts` without replacement, so a given expert is missed by one
    token with probability 1 - k/E and by all t tokens with (1 - k/E)^t.
    Example: uniform_unique_experts(128, 8, 4) == 29.1 (to 0.1), the seed's uniform baseline.
    """
    _check_routing(n_experts, top_k)
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens!r}")
    miss_one_token = 1.0 - top_k / n_experts
    return n_experts * (1.0 - miss_one_token**n_tokens)


def saturation_threshold(top_k: int, n_experts: int, tau: float = 0.95) -> int:
    """Tokens after which a layer is "almost fully activated": N(t) >= tau * E (MoESD T_thres).

    T_thres = ceil(log_{1-rho}(1 - tau)), rho = k/E. At tau = 0.95: rho = 1/8 -> 23,
    1/16 -> 47, 1/32 -> 95. Beyond it, extra verify tokens add almost no weight traffic.
    When k == E every token activates everything, so the threshold is 1.
    """
    _check_routing(n_experts, top_k)
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau must be in (0, 1), got {tau!r}")
    if top_k == n_experts:
        return 1
    rho = top_k / n_experts
    exact = math.log(1.0 - tau) / math.log(1.0 - rho)
    # A tiny tolerance keeps an exact integer from rounding up through float noise.
    return max(1, math.ceil(exact - 1e-9))


def tokens_per_expert(n_experts: int, top_k: int, n_tokens: float) -> float:
    """Average tokens served per activated expert for a batch of `n_tokens` (MoESD).

    Equals rho * t / (1 - (1 - rho)^t): 1.0 for one token, rising towards rho * t once the layer
    saturates. It is the arithmetic-intensity multiplier of an expert's weight read.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens!r}")
    unique = uniform_unique_experts(n_experts, top_k, n_tokens)
    return top_k * n_tokens / unique


def expected_tokens_per_round(acceptance_rate: float, draft_len: int) -> float:
    """Tokens emitted per speculative round with K drafted tokens and i.i.d. acceptance alpha.

    The target accepts a prefix of the draft and always adds one token of its own, so the yield
    is 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha), and K + 1 when alpha = 1.
    """
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
    if not isinstance(draft_len, int) or draft_len < 0:
        raise ValueError(f"draft_len must be an int >= 0, got {draft_len!r}")
    if acceptance_rate == 1.0:
        return float(draft_len + 1)
    return (1.0 - acceptance_rate ** (draft_len + 1)) / (1.0 - acceptance_rate)


def verify_cost_ratio(expert_fraction: float, unique_expert_ratio: float) -> float:
    """T(K+1)/T(1) by the Amdahl split: (1 - f) + f * U(K+1)/U(1).

    `expert_fraction` f is the share of a one-token step spent on routed-expert weights;
    `unique_expert_ratio` is unique experts in the verify window over those of one token (U/k).
    Cohere: f = 0.30 and 20.36/8 unique experts give 1.46.
    """
    if not 0.0 <= expert_fraction <= 1.0:
        raise ValueError(f"expert_fraction must be in [0, 1], got {expert_fraction!r}")
    if unique_expert_ratio < 1.0:
        raise ValueError(f"unique_expert_ratio must be >= 1, got {unique_expert_ratio!r}")
    return (1.0 - expert_fraction) + expert_fraction * unique_expert_ratio


def speculative_speedup(
    tokens_per_round: float, verify_ratio: float, draft_ratio: float = 0.0
) -> float:
    """MoESD speedup: tokens per round over (drafter-to-target ratio + verify-to-decode ratio).

    `draft_ratio` is K * T_D(1) / T_T(1), the whole draft phase in units of one target step;
    `verify_ratio` is T_T(K+1) / T_T(1). Cohere: 2.73 tokens over 1.46 -> 1.87x; over 1.25 -> 2.18x.
    """
    if tokens_per_round < 1.0:
        raise ValueError(f"tokens_per_round must be >= 1, got {tokens_per_round!r}")
    if verify_ratio <= 0.0:
        raise ValueError(f"verify_ratio must be > 0, got {verify_ratio!r}")
    if draft_ratio < 0.0:
        raise ValueError(f"draft_ratio must be >= 0, got {draft_ratio!r}")
    return tokens_per_round / (draft_ratio + verify_ratio)


def power_law_hit_rate(cache_fraction: float, exponent: float) -> float:
    """A prior for cache hit rate from the share of expert bytes cached: h = c^exponent.

    Routing is skewed and temporally correlated, so a cache holding a fraction c of the experts
    hits far more often than c. With exponent < 1 the curve is concave, 0 at c = 0 and 1 at c = 1.
    It is a rough prior fitted to published (fraction, hit rate) pairs, not a trace replay.
    """
    if not 0.0 <= cache_fraction <= 1.0:
        raise ValueError(f"cache_fraction must be in [0, 1], got {cache_fraction!r}")
    if not 0.0 < exponent <= 1.0:
        raise ValueError(f"exponent must be in (0, 1], got {exponent!r}")
    if cache_fraction == 0.0:
        return 0.0
    return cache_fraction**exponent


def fit_power_law_exponent(points: list[tuple[float, float]]) -> float:
    """Least-squares exponent b of h = c^b in log space (a line through the origin).

    `points` are (cache_fraction, hit_rate) pairs, each strictly inside (0, 1).
    b = sum(ln c * ln h) / sum(ln c ^ 2).
    """
    if not points:
        raise ValueError("fit_power_law_exponent needs at least one (fraction, hit_rate) point")
    numerator = 0.0
    denominator = 0.0
    for cache_fraction, hit_rate in points:
        if not (0.0 < cache_fraction < 1.0 and 0.0 < hit_rate < 1.0):
            raise ValueError(
                f"points must lie strictly inside (0, 1); got ({cache_fraction!r}, {hit_rate!r})"
            )
        log_fraction = math.log(cache_fraction)
        numerator += log_fraction * math.log(hit_rate)
        denominator += log_fraction * log_fraction
    return numerator / denominator
