"""Planner: will a MoE model fit on a Mac, and how fast will it decode (a projection, not a measurement).

Memory: resident weights + KV at a context length + drafter + headroom + expert cache must fit
the GPU working set; RAM left after that and macOS's share may act as an OS page-cache tier.

Time of one target forward over T tokens (T = 1 for plain decode, K+1 for a verify pass):
    dense     = max(resident bytes read + KV bytes, 2 * dense params * T / FLOPS) / bandwidth
    experts   = max(U(T) * L * expert bytes / bandwidth, expert FLOPs)   U(T): unique experts per layer
    I/O       = U(T) * L * expert bytes * (page-cache share / page-cache GB/s + SSD share / SSD GB/s)
    sync      = v1: L * sync_ms_per_layer (one constant fitted to one published run)
                v2: host syncs (per forward, or per MoE layer below a full budget), command buffers, layer
                    time and repairs counted from the engine's code, priced at MLX's measured sync costs
Prefetch hides up to recall * I/O behind the compute and sync time of the same pass (an upper bound:
it ignores the memory-controller contention [FM] reports). Speculation follows MoESD's
decomposition: a round costs K drafter steps + one verify forward (+ a rollback re-run for models
whose recurrent or windowed state cannot be trimmed) and yields (1 - a^(K+1)) / (1 - a) tokens.

Invariants: pure functions of frozen dataclasses; bad input raises ValueError naming the value;
every tok/s this module returns is a projection and is labelled so by projection_json().
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from runtime.cache import HEADROOM_FRACTION, HEADROOM_MIN_BYTES, BudgetSpec
from runtime.plan.engine_costs import EngineProfile, engine_overhead
from runtime.plan.mac_profiles import MacProfile
from runtime.plan.model_costs import ModelCosts
from runtime.plan.model_presets import hit_rate_observations
from runtime.observe import expected_tokens_per_round, fit_power_law_exponent, power_law_hit_rate, uniform_unique_experts

__all__ = [
    "CostConstants", "MemoryPlan", "default_headroom_bytes", "plan_memory", "HitRates", "hit_rates",
    "hit_rate_prior_exponent", "ForwardTime", "forward_time", "SpecAssumptions", "SpecBreakdown", "Projection",
    "project", "required_hit_rate", "projection_json", "DEFAULT_SYNC_MS_PER_LAYER", "draft_token_ms",
]

# Fitted by bench/validate_planner.py on one published run (Qwen3.5-35B-A3B, K=8, M1 Pro 16 GB,
# 8.28 tok/s [M1P]); re-run the bench and paste its "fitted" value here when the model changes.
DEFAULT_SYNC_MS_PER_LAYER = 1.342


@dataclass(frozen=True)
class CostConstants:
    sync_ms_per_layer: float = DEFAULT_SYNC_MS_PER_LAYER  # v1: host round-trips + launches per MoE layer per forward
    mem_efficiency: float = 1.0  # achieved/peak memory bandwidth ([FM]: ~418 GiB/s on a 400 GB/s M3 Max)
    engine: EngineProfile | None = None  # v2: syncs, buffers, layer time and repairs from the code (engine_costs.py)

    def __post_init__(self) -> None:
        if self.sync_ms_per_layer < 0:
            raise ValueError(f"sync_ms_per_layer must be >= 0, got {self.sync_ms_per_layer!r}")
        if not 0 < self.mem_efficiency <= 1.5:
            raise ValueError(f"mem_efficiency must be in (0, 1.5], got {self.mem_efficiency!r}")


@dataclass(frozen=True)
class MemoryPlan:
    working_set_bytes: int  # GPU working-set limit the budget must fit in
    resident_bytes: int  # non-expert weights
    kv_bytes: int  # KV cache + recurrent state at context_tokens
    context_tokens: int  # context length the KV figure is for
    drafter_bytes: int  # drafter weights (0 without speculation)
    headroom_bytes: int  # activations, scratch, allocator slack
    cache_bytes: int  # expert cache budget (capped at all expert bytes)
    expert_total_bytes: int  # all routed experts
    min_cache_bytes: int  # one token's experts: below this nothing runs
    page_cache_bytes: int  # RAM left for the OS page cache tier (0 when the tier is off)
    fits: bool  # everything fits the working set and the cache holds one token's experts
    advice: tuple[str, ...]  # what to change when it does not fit

    @property
    def cache_fraction(self) -> float:
        return self.cache_bytes / self.expert_total_bytes

    @property
    def used_bytes(self) -> int:
        return self.resident_bytes + self.kv_bytes + self.drafter_bytes + self.headroom_bytes + self.cache_bytes

    @property
    def free_bytes(self) -> int:
        return self.working_set_bytes - self.used_bytes


def default_headroom_bytes(mac: MacProfile) -> int:
    """Headroom the runtime keeps under --budget auto (runtime/cache/budget.py's rule), for the same answer."""
    usable = min(mac.ram_bytes, mac.gpu_working_set_bytes)
    return max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * usable))


def plan_memory(
    model: ModelCosts,
    mac: MacProfile,
    budget: BudgetSpec,
    context_tokens: int = 4096,
    headroom_bytes: int | None = None,
    drafter_bytes: int = 0,
    page_cache: bool = False,
) -> MemoryPlan:
    """Memory breakdown; `fits` is False (with advice) when the working set is exceeded."""
    if headroom_bytes is None:
        headroom_bytes = default_headroom_bytes(mac)
    if headroom_bytes < 0 or drafter_bytes < 0:
        raise ValueError(f"headroom/drafter bytes must be >= 0, got {headroom_bytes!r}/{drafter_bytes!r}")
    kv_bytes = model.kv_bytes(context_tokens)
    fixed = model.resident_bytes + kv_bytes + drafter_bytes + headroom_bytes
    available = mac.gpu_working_set_bytes - fixed
    if budget.kind == "auto":
        cache = max(0, min(available, model.expert_total_bytes))
    elif budget.kind == "fraction":
        cache = int(budget.value * model.expert_total_bytes)
    else:
        cache = min(int(budget.value), model.expert_total_bytes)
    min_cache = model.top_k * model.n_moe_layers * model.expert_bytes
    advice: list[str] = []
    if available < min_cache:
        needed_mib = math.ceil((fixed + min_cache) / (1 << 20))
        changes = ["use fewer --bits", "a shorter --context"]
        if needed_mib * (1 << 20) <= mac.ram_bytes - mac.os_reserved_bytes:
            changes.append(f"raise iogpu.wired_limit_mb to at least {needed_mib}")
        changes.append("a Mac with more RAM")
        advice.append(
            f"resident weights + KV + headroom + one token's experts need {(fixed + min_cache) / 1e9:.2f} GB "
            f"of a {mac.gpu_working_set_bytes / 1e9:.2f} GB working set: " + ", ".join(changes)
        )
    elif cache > available:
        advice.append(f"lower --budget to at most {available / 1e9:.2f} GB (or use --budget auto)")
    if cache < min_cache and available >= min_cache:
        advice.append(f"the expert cache must hold one token's experts: --budget of at least {min_cache / 1e9:.2f} GB")
    fits = not advice
    page_cache_bytes = 0
    if page_cache:
        leftover = mac.ram_bytes - mac.os_reserved_bytes - fixed - cache
        page_cache_bytes = max(0, min(leftover, model.expert_total_bytes - cache))
    return MemoryPlan(
        working_set_bytes=mac.gpu_working_set_bytes, resident_bytes=model.resident_bytes,
        kv_bytes=kv_bytes, context_tokens=context_tokens, drafter_bytes=drafter_bytes,
        headroom_bytes=headroom_bytes, cache_bytes=int(cache),
        expert_total_bytes=model.expert_total_bytes, min_cache_bytes=min_cache,
        page_cache_bytes=int(page_cache_bytes), fits=fits, advice=tuple(advice),
    )


@dataclass(frozen=True)
class HitRates:
    cache: float  # share of routed-expert reads served by the expert cache (already in memory)
    page_cache: float  # share served by pread from the OS page cache
    source: str  # where the numbers came from: "given", "all experts cached", "prior h=c^b"
    full_budget: bool | None = None  # the cache holds every expert (the engine's sync counts); None: cache == 1

    def __post_init__(self) -> None:
        if not (0 <= self.cache <= 1 and 0 <= self.page_cache <= 1 and self.cache + self.page_cache <= 1 + 1e-9):
            raise ValueError(f"hit rates must be shares summing to <= 1, got {self.cache!r} + {self.page_cache!r}")

    @property
    def ssd(self) -> float:
        return max(0.0, 1.0 - self.cache - self.page_cache)

    @property
    def holds_every_expert(self) -> bool:  # the budget the engine's sync counts follow
        return self.cache >= 1.0 if self.full_budget is None else self.full_budget


@lru_cache(maxsize=1)
def hit_rate_prior_exponent() -> float:
    """Exponent b of the default prior h = c^b, fitted to the published points in model_presets.json."""
    points = [(p["cache_fraction"], p["hit_rate"]) for p in hit_rate_observations()]
    return fit_power_law_exponent(points)


def hit_rates(memory: MemoryPlan, hit_rate: float | None = None) -> HitRates:
    """Per-tier hit rates: the given cache hit rate, or the prior; the page cache catches a share of misses."""
    if hit_rate is not None and not 0 <= hit_rate <= 1:
        raise ValueError(f"--hit-rate must be in [0, 1], got {hit_rate!r}")
    if memory.cache_bytes >= memory.expert_total_bytes:
        return HitRates(1.0, 0.0, "all experts cached", full_budget=True)
    exponent = hit_rate_prior_exponent()
    cached = memory.cache_fraction
    prior_cache = power_law_hit_rate(cached, exponent)
    cache = prior_cache if hit_rate is None else hit_rate
    source = "given (--hit-rate)" if hit_rate is not None else f"prior h=c^{exponent:.3f} of published hit rates"
    page = 0.0
    if memory.page_cache_bytes > 0:
        both = min(1.0, cached + memory.page_cache_bytes / memory.expert_total_bytes)
        # The page cache catches the share of the cache's misses the prior says the larger pool catches.
        caught = (power_law_hit_rate(both, exponent) - prior_cache) / max(1e-12, 1.0 - prior_cache)
        page = (1.0 - cache) * caught
    return HitRates(cache, page, source, full_budget=False)


@dataclass(frozen=True)
class ForwardTime:
    n_tokens: int  # tokens in this forward (1 = decode, K+1 = verify)
    unique_experts_per_layer: float  # distinct routed experts per MoE layer
    dense_ms: float  # resident weights + KV, bandwidth/compute roofline
    expert_compute_ms: float  # routed experts read from memory (or their FLOPs)
    page_cache_ms: float  # pread from the OS page cache
    ssd_ms: float  # pread from SSD
    hidden_io_ms: float  # I/O hidden behind compute by prefetch
    sync_ms: float  # fixed costs: v1 per-layer constant; v2 host syncs + command buffers + layer time
    repair_ms: float = 0.0  # v2: repairs (a sync and a partial re-run each)
    repairs: float = 0.0  # v2: repairs of this forward
    host_syncs: float = 0.0  # v2: host syncs of this forward, repairs included
    routed_layers: float = 0  # v2: MoE layers a verify window syncs the routing of (below a full budget)

    @property
    def io_ms(self) -> float:
        return self.page_cache_ms + self.ssd_ms

    @property
    def total_ms(self) -> float:
        return self.dense_ms + self.expert_compute_ms + self.io_ms - self.hidden_io_ms + self.sync_ms + self.repair_ms


def forward_time(
    model: ModelCosts,
    mac: MacProfile,
    hits: HitRates,
    constants: CostConstants,
    *,
    n_tokens: int = 1,
    context_tokens: int = 0,
    unique_expert_scale: float = 1.0,
    prefetch_recall: float = 0.0,
    extra_overlap_ms: float = 0.0,
    window: bool | None = None,
) -> ForwardTime:
    """Time of one target forward over `n_tokens` tokens (module docstring); `window`: a verify window or
    its re-run, a device pass at any budget (default: n_tokens > 1)."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens!r}")
    if not 0 <= prefetch_recall <= 1:
        raise ValueError(f"--prefetch-recall must be in [0, 1], got {prefetch_recall!r}")
    if not 0 < unique_expert_scale <= 1:
        raise ValueError(f"--overlap-scale must be in (0, 1], got {unique_expert_scale!r}")
    bytes_per_ms = mac.mem_bandwidth_gbps * constants.mem_efficiency * 1e6
    flops_per_ms = mac.gpu_tflops * 1e9
    uniform = uniform_unique_experts(model.n_experts, model.top_k, n_tokens)
    unique = max(float(model.top_k), unique_expert_scale * uniform)
    expert_bytes = unique * model.n_moe_layers * model.expert_bytes
    dense_params = model.active_params_per_token - model.top_k * model.n_moe_layers * model.expert_params
    dense_ms = max(
        (model.resident_read_bytes_per_token + model.kv_bytes(context_tokens)) / bytes_per_ms,
        2 * dense_params * n_tokens / flops_per_ms,
    )
    expert_flops = 2 * n_tokens * model.top_k * model.n_moe_layers * model.expert_params
    expert_ms = max(expert_bytes / bytes_per_ms, expert_flops / flops_per_ms)
    page_cache_ms = expert_bytes * hits.page_cache / (mac.page_cache_read_gbps * 1e6)
    ssd_ms = expert_bytes * hits.ssd / (mac.ssd_read_gbps * 1e6)
    repair_ms = repairs = host_syncs = routed = 0.0
    if constants.engine is None:
        sync_ms = model.n_moe_layers * constants.sync_ms_per_layer
    else:
        overhead = engine_overhead(constants.engine, model.n_moe_layers, dense_ms + expert_ms, 1.0 - hits.cache,
                                   unique * model.n_moe_layers, full_budget=hits.holds_every_expert,
                                   window=n_tokens > 1 if window is None else window, depth=model.n_layers)
        sync_ms = overhead.sync_ms + overhead.command_buffer_ms + overhead.layer_ms
        repair_ms, repairs, routed = overhead.repair_ms, overhead.repairs, overhead.routed_layers
        host_syncs = overhead.host_syncs + repairs
    # The loader runs on its own threads: it can work through compute and host syncs alike.
    window_ms = dense_ms + expert_ms + sync_ms + extra_overlap_ms
    hidden_ms = min(prefetch_recall * (page_cache_ms + ssd_ms), window_ms)
    return ForwardTime(n_tokens, unique, dense_ms, expert_ms, page_cache_ms, ssd_ms, hidden_ms, sync_ms,
                       repair_ms, repairs, host_syncs, routed)


@dataclass(frozen=True)
class SpecAssumptions:
    draft_len: int = 3  # K tokens drafted per round (verify window K+1)
    acceptance_rate: float = 0.75  # i.i.d. per-token acceptance (0.75 gives Cohere's 2.73 tokens at K=3)
    drafter_bytes: int = 300_000_000  # drafter weights read per drafted token (~0.5B params at 4-bit)
    unique_expert_scale: float = 1.0  # measured/uniform unique experts in the window (Cohere: 20.36/29.1)

    def __post_init__(self) -> None:
        if not isinstance(self.draft_len, int) or not 1 <= self.draft_len <= 32:
            raise ValueError(f"--num-draft must be an int in [1, 32], got {self.draft_len!r}")
        if not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"--acceptance must be in [0, 1], got {self.acceptance_rate!r}")
        if self.drafter_bytes < 0:
            raise ValueError(f"--drafter-gb must be >= 0, got {self.drafter_bytes!r}")


def draft_token_ms(model: ModelCosts, mac: MacProfile, spec: SpecAssumptions, constants: CostConstants) -> float:
    """One drafted token: a read of the drafter's weights plus one host round-trip (v1: the per-layer
    constant); v2 adds the drafter's own layer time, its depth assumed half the target's."""
    read_ms = spec.drafter_bytes / (mac.mem_bandwidth_gbps * constants.mem_efficiency * 1e6)
    engine = constants.engine
    if engine is None:
        return read_ms + constants.sync_ms_per_layer
    layers = model.n_layers / 2
    return read_ms + engine.sync_us / 1000 + layers * (engine.layer_us + engine.command_buffer_us) / 1000


@dataclass(frozen=True)
class SpecBreakdown:
    tokens_per_round: float  # accepted drafts + the target's own token
    target_step_ms: float  # T_T(1): one plain decode step
    draft_ms: float  # K * T_D(1): the whole draft phase
    verify_ms: float  # T_T(K+1): one verify forward
    rollback_ms: float  # expected re-run of accepted tokens when state cannot be trimmed
    unique_experts_per_layer: float  # unique experts in the verify window
    draft_ratio: float  # K * T_D(1) / T_T(1)
    verify_ratio: float  # T_T(K+1) / T_T(1), MoESD's target-efficiency inverse
    speedup: float  # tokens per round over round time, in units of T_T(1)


@dataclass(frozen=True)
class Projection:
    label: str  # "baseline", "prefetch", "speculative", "speculative + prefetch"
    tok_per_s: float  # projected decode tokens per second
    ms_per_token: float  # projected milliseconds per emitted token
    step: ForwardTime  # the plain-decode (or verify) forward behind the figure
    spec: SpecBreakdown | None  # speculative decomposition, None without speculation


def project(
    model: ModelCosts,
    mac: MacProfile,
    hits: HitRates,
    constants: CostConstants,
    *,
    context_tokens: int = 4096,
    spec: SpecAssumptions | None = None,
    prefetch_recall: float = 0.0,
    label: str = "",
) -> Projection:
    """Projected decode speed, with speculation when `spec` is given and prefetch when recall > 0."""
    step = forward_time(model, mac, hits, constants, context_tokens=context_tokens,
                        prefetch_recall=prefetch_recall)
    if spec is None:
        return Projection(label or "baseline", 1000.0 / step.total_ms, step.total_ms, step, None)
    draft_ms = spec.draft_len * draft_token_ms(model, mac, spec, constants)
    # With speculation the loader can also work while the drafter runs.
    verify = forward_time(model, mac, hits, constants, n_tokens=spec.draft_len + 1,
                          context_tokens=context_tokens, unique_expert_scale=spec.unique_expert_scale,
                          prefetch_recall=prefetch_recall, extra_overlap_ms=draft_ms)
    tokens = expected_tokens_per_round(spec.acceptance_rate, spec.draft_len)
    rollback_ms = 0.0
    if model.state_bytes or model.window_tokens:
        # Recurrent/windowed state is restored from a snapshot and the accepted tokens re-run; their
        # experts were just loaded, so the re-run reads memory only.
        accepted = max(1, round(tokens - 1))
        rerun = forward_time(model, mac, HitRates(1.0, 0.0, "re-run"), constants,
                             n_tokens=accepted, context_tokens=context_tokens, window=True)
        rollback_ms = (1 - spec.acceptance_rate**spec.draft_len) * rerun.total_ms
    round_ms = draft_ms + verify.total_ms + rollback_ms
    breakdown = SpecBreakdown(
        tokens_per_round=tokens, target_step_ms=step.total_ms, draft_ms=draft_ms,
        verify_ms=verify.total_ms, rollback_ms=rollback_ms,
        unique_experts_per_layer=verify.unique_experts_per_layer,
        draft_ratio=draft_ms / step.total_ms, verify_ratio=verify.total_ms / step.total_ms,
        speedup=tokens * step.total_ms / round_ms,
    )
    ms_per_token = round_ms / tokens
    return Projection(label or "speculative", 1000.0 / ms_per_token, ms_per_token, verify, breakdown)


def required_hit_rate(
    target_tok_s: float,
    model: ModelCosts,
    mac: MacProfile,
    constants: CostConstants,
    *,
    context_tokens: int = 4096,
    spec: SpecAssumptions | None = None,
    prefetch_recall: float = 0.0,
    full_budget: bool | None = None,
) -> float | None:
    """Smallest expert-cache hit rate (no page cache) reaching `target_tok_s`, None if even 100% misses it;
    `full_budget`: the plan's budget holds every expert (None: only at a 100% hit rate)."""
    if not target_tok_s > 0:
        raise ValueError(f"--target-tok-s must be > 0, got {target_tok_s!r}")

    def speed(hit: float) -> float:
        return project(model, mac, HitRates(hit, 0.0, "solve", full_budget), constants, context_tokens=context_tokens,
                       spec=spec, prefetch_recall=prefetch_recall).tok_per_s

    if speed(1.0) < target_tok_s:
        return None
    if speed(0.0) >= target_tok_s:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(40):  # bisection: speed rises monotonically with the hit rate
        middle = (low + high) / 2
        low, high = (middle, high) if speed(middle) < target_tok_s else (low, middle)
    return high


def projection_json(projection: Projection) -> dict:
    """A projection as JSON-ready data, explicitly labelled as a projection."""
    data = asdict(projection)
    data["kind"] = "projection"
    data["step"]["total_ms"] = projection.step.total_ms
    return data
