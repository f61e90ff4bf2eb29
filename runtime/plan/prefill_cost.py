"""Prefill and long-context projections: time to first token with expert-major reads, and the longest
context that fits when the KV cache grows and the expert cache gives slots back.

Time to first token over a prompt of T tokens (expert-major prefill: each MoE layer routes
all T tokens, then reads each routed expert once):
    unique    = U(T) experts per layer, MoESD's uniform E(1 - (1 - k/E)^T)   (an upper bound)
    reads     = unique x MoE layers x expert bytes x (1 - cached share)       read once each, cold SSD
    compute   = max(resident + unique expert bytes / bandwidth, prompt FLOPs / GPU FLOPS)
    fixed     = MoE layers x (layer time + one host sync: the layer's routing read-back)
    TTFT      = max(reads, compute) + fixed + one decode step                  reads overlap compute

Longest context: resident + KV(context) + drafter + headroom + one token's experts must fit the
working set; KV follows ModelCosts.kv_bytes (growing layers only; windows capped; fixed state).

Invariants: pure functions; bad input raises ValueError naming the flag; every figure is a
projection, and the assumptions are listed in the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.plan.engine_costs import MLX_DEFAULT_FENCE_US, DEFAULT_LAYER_US
from runtime.plan.mac_profiles import MacProfile
from runtime.plan.model_costs import ModelCosts

__all__ = ["PrefillTime", "prefill_time", "max_context_tokens", "PREFILL_ASSUMPTIONS"]

PREFILL_ASSUMPTIONS = (
    "prefill reads come from the SSD (a cold prompt), each routed expert once",
    "unique experts per layer follow uniform routing (an upper bound on reads)",
    "prefill matmuls reach the chip's peak FLOPS",
)


@dataclass(frozen=True)
class PrefillTime:
    prompt_tokens: int  # T
    unique_experts_per_layer: float  # distinct experts the prompt routes to, per MoE layer
    read_bytes: int  # expert bytes read from the SSD (each once)
    io_ms: float  # reading them
    compute_ms: float  # the prompt's forward (roofline)
    fixed_ms: float  # per-layer time and routing read-backs
    first_token_ms: float  # the decode step that makes the first token

    @property
    def ttft_ms(self) -> float:
        return max(self.io_ms, self.compute_ms) + self.fixed_ms + self.first_token_ms


def prefill_time(model: ModelCosts, mac: MacProfile, prompt_tokens: int, cached_share: float,
                 first_token_ms: float, *, layer_us: float = DEFAULT_LAYER_US,
                 sync_us: float = MLX_DEFAULT_FENCE_US) -> PrefillTime:
    """Projected time to first token for `prompt_tokens` with `cached_share` of expert bytes cached."""
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be an int >= 1, got {prompt_tokens!r}")
    if not 0 <= cached_share <= 1:
        raise ValueError(f"cached share must be in [0, 1], got {cached_share!r}")
    e, k = model.n_experts, model.top_k
    unique = e * (1 - (1 - k / e) ** prompt_tokens)
    expert_bytes = unique * model.n_moe_layers * model.expert_bytes
    read_bytes = int(expert_bytes * (1 - cached_share))
    io_ms = read_bytes / (mac.ssd_read_gbps * 1e6)
    dense_params = model.active_params_per_token - k * model.n_moe_layers * model.expert_params
    flops = 2 * prompt_tokens * (dense_params + k * model.n_moe_layers * model.expert_params)
    compute_ms = max((model.resident_bytes + expert_bytes + model.kv_bytes(prompt_tokens))
                     / (mac.mem_bandwidth_gbps * 1e6), flops / (mac.gpu_tflops * 1e9))
    fixed_ms = model.n_moe_layers * (layer_us + sync_us) / 1000
    return PrefillTime(prompt_tokens, unique, read_bytes, io_ms, compute_ms, fixed_ms, first_token_ms)


def max_context_tokens(model: ModelCosts, mac: MacProfile, *, headroom_bytes: int, drafter_bytes: int = 0,
                       limit: int = 1 << 24) -> int:
    """Longest context whose KV fits beside resident weights, drafter, headroom and one token's experts
    (the expert cache gives back slots as the KV grows); 0 when not even an empty context fits."""
    min_cache = model.top_k * model.n_moe_layers * model.expert_bytes
    room = mac.gpu_working_set_bytes - model.resident_bytes - drafter_bytes - headroom_bytes - min_cache
    if room < model.kv_bytes(0):
        return 0
    if model.kv_bytes(limit) <= room:
        return limit
    low, high = 0, limit  # kv_bytes rises with context: bisect
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if model.kv_bytes(middle) <= room else (low, middle)
    return low
