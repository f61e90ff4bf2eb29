"""Pipeline planner: N Macs over a link, each rank owning a range of layers with its own expert cache.

A projection, not a measurement. Each rank is projected with the single-Mac cost model
(runtime.plan.planner: plan_memory, hit_rates, forward_time) applied to its share of the model:
its MoE layers' experts, their resident weights and KV (rank 0 also the embedding and LM head,
and the drafter). The split is the runtime's (runtime/plan/stage_split.py: contiguous, balanced by
bytes). One decode token runs the stages one after another, so

    token_ms = sum over ranks of forward_ms(rank) + N hops * (latency + T*D*2 bytes / link bandwidth)

(N hops: 0 -> 1 -> ... -> N-1 -> 0). A speculative round adds rank 0's draft phase and each rank's
re-run of accepted tokens when its state cannot be trimmed (as the single-Mac planner); every rank's
loader can prefetch through it (the forecasts reach each rank during the draft), so each rank's
verify forward gets the draft time as extra overlap; forecast messages are small sends during
the draft and are not charged. More Macs do not make one token faster (the stages are serial);
they make each rank's cache a larger share of its experts, so hit rates rise and SSD reads fall.

Link figures and their sources are in LINKS; "assumption" marks a stand-in without a source.
Invariants: pure functions of frozen dataclasses; bad input raises ValueError naming the value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from runtime.cache import BudgetSpec
from runtime.plan.mac_profiles import MacProfile
from runtime.plan.model_costs import ModelCosts, affine_bytes_per_weight
from runtime.plan.planner import CostConstants, HitRates, SpecAssumptions, forward_time, hit_rates, plan_memory, project
from runtime.plan.stage_split import balanced_split


@dataclass(frozen=True)
class LinkProfile:
    name: str  # id, e.g. "tb5-rdma"
    label: str  # human label
    latency_us: float  # one message, end to end (send to receive), microseconds
    gbytes_per_s: float  # achievable payload bandwidth, GB/s
    source: str  # where the figures come from

    def hop_ms(self, payload_bytes: int) -> float:
        return self.latency_us / 1000 + payload_bytes / (self.gbytes_per_s * 1e6)


_TN3205 = ("Apple TN3205 (Mar 2026) as reported at adwaitx.com/?p=10695: ~300 us over TCP, under 50 us with "
           "RDMA over Thunderbolt")
LINKS = {
    "tb4": LinkProfile("tb4", "Thunderbolt 4, TCP/IP (mlx ring)", 300.0, 2.5,
                       f"latency: {_TN3205} (TCP figure); bandwidth: assumption, half of TB4's 40 Gb/s line rate"),
    "tb5": LinkProfile("tb5", "Thunderbolt 5, TCP/IP (mlx ring)", 300.0, 5.0,
                       f"latency: {_TN3205} (TCP figure); bandwidth: assumption, half of TB5's 80 Gb/s line rate"),
    "tb5-rdma": LinkProfile("tb5-rdma", "Thunderbolt 5, RDMA (mlx JACCL, macOS 26.2+)", 50.0, 3.5,
                            f"latency: {_TN3205} (RDMA bound; users report 5-9 us, techboards.net thread 5374); "
                            "bandwidth: 3.5-3.8 GB/s sustained over JACCL, github.com/ml-explore/mlx/issues/3207"),
    "10gbe": LinkProfile("10gbe", "10 Gigabit Ethernet, TCP/IP (mlx ring)", 300.0, 1.1,
                         f"latency: assumption, the TCP figure of {_TN3205}; bandwidth: 10 Gb/s line rate less ~10% "
                         "protocol overhead (assumption)"),
}


def link_profile(name: str) -> LinkProfile:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"--link {name!r}; expected one of {', '.join(LINKS)}") from None


@dataclass(frozen=True)
class RankPlan:
    rank: int
    n_moe_layers: int  # MoE layers this rank owns
    resident_bytes: int  # its non-expert weights (rank 0: + embedding and head)
    kv_bytes: int  # its KV cache + recurrent state at the context length
    cache_bytes: int  # its expert cache (plain decode)
    expert_bytes: int  # all routed experts of its layers
    fits: bool  # fits this Mac's GPU working set
    hit_rate: float  # projected expert-cache hit rate (plain decode)
    step_ms: float  # its share of one plain decode step
    drafter_bytes: int = 0  # rank 0 with speculation: the drafter, which takes cache room
    spec_hit_rate: float = 0.0  # hit rate with the drafter resident (rank 0's cache is smaller)
    verify_ms: float = 0.0  # its share of one verify forward (0 without speculation)

    @property
    def memory_bytes(self) -> int:
        """Resident + KV + cache of plain decode (the cache shrinks by the drafter under speculation, --budget auto)."""
        return self.resident_bytes + self.kv_bytes + self.cache_bytes


@dataclass(frozen=True)
class PipelinePlan:
    model: str
    mac: str
    link: str
    n_ranks: int
    ranks: tuple[RankPlan, ...]
    hop_ms: float  # one hop of a decode step's hidden state
    verify_hop_ms: float  # one hop of a verify window's hidden states
    plain_tok_s: float  # projected plain decode tok/s through the pipeline
    spec_tok_s: float | None  # projected speculative tok/s (None without speculation)
    single_tok_s: float  # the same model on one such Mac (plain), for comparison
    single_spec_tok_s: float | None  # ... speculative
    single_fits: bool  # whether it fits one Mac at all
    single_hit_rate: float

    def to_json(self) -> dict:
        d = asdict(self)
        d["kind"] = "projection"
        for r, rank in zip(d["ranks"], self.ranks):
            r["memory_bytes"] = rank.memory_bytes
        return d


def head_bytes(config: dict, bits: int = 4, group_size: int = 64) -> int:
    """Embedding + LM head bytes (one table when tied), quantized as mlx-community checkpoints are."""
    cfg = config.get("text_config", config)
    tables = 1 if cfg.get("tie_word_embeddings", False) else 2
    return int(tables * cfg["vocab_size"] * cfg["hidden_size"] * affine_bytes_per_weight(bits, group_size))


def split_layers(model: ModelCosts, n_ranks: int, outside_bytes: int) -> list[int]:
    """MoE layers per rank, balanced by bytes as the runtime splits (rank 0 carries `outside_bytes`)."""
    L = model.n_moe_layers
    per_layer = (model.resident_bytes - outside_bytes) / L + model.expert_total_bytes / L
    split = balanced_split([int(per_layer)] * L, n_ranks, outside_bytes)
    return [b - a for a, b in split.ranges]


def _rank_model(model: ModelCosts, n_layers: int, rank: int, outside: int, outside_read: int) -> ModelCosts:
    if n_layers == model.n_moe_layers:
        return model  # one rank: the whole model
    share = n_layers / model.n_moe_layers
    return replace(
        model, n_layers=max(1, round(model.n_layers * share)), n_moe_layers=n_layers,
        expert_total_bytes=n_layers * model.n_experts * model.expert_bytes,
        resident_bytes=int((model.resident_bytes - outside) * share) + (outside if rank == 0 else 0),
        resident_read_bytes_per_token=int((model.resident_read_bytes_per_token - outside_read) * share)
        + (outside_read if rank == 0 else 0),
        kv_bytes_per_token=int(model.kv_bytes_per_token * share),
        window_kv_bytes_per_token=int(model.window_kv_bytes_per_token * share),
        state_bytes=int(model.state_bytes * share),
        active_params_per_token=int(model.active_params_per_token * share),
    )


def project_pipeline(model: ModelCosts, config: dict, mac: MacProfile, n_ranks: int, link: LinkProfile, *,
                     budget: BudgetSpec = BudgetSpec("auto", 0.0, "auto"), context_tokens: int = 4096,
                     spec: SpecAssumptions | None = None, prefetch_recall: float = 0.0,
                     constants: CostConstants = CostConstants(), bits: int = 4) -> PipelinePlan:
    """Project `model` over `n_ranks` Macs like `mac` joined by `link` (see the module docstring)."""
    if not 1 <= n_ranks <= model.n_moe_layers:
        raise ValueError(f"--ranks {n_ranks}; expected 1..{model.n_moe_layers} (one MoE layer per rank at least)")
    outside = head_bytes(config, bits)
    cfg = config.get("text_config", config)
    tied = cfg.get("tie_word_embeddings", False)
    # A token reads one embedding row and the whole head: with tied tables the head is the embedding.
    outside_read = int(outside if tied else outside / 2)
    counts = split_layers(model, n_ranks, outside)
    window = spec.draft_len + 1 if spec else 1
    hidden_bytes = model.hidden_size * 2  # bf16 hidden states
    draft_ms = 0.0
    if spec is not None:
        bytes_per_ms = mac.mem_bandwidth_gbps * constants.mem_efficiency * 1e6
        draft_ms = spec.draft_len * (spec.drafter_bytes / bytes_per_ms + constants.sync_ms_per_layer)
    ranks = []
    for r, n in enumerate(counts):
        rm = _rank_model(model, n, r, outside, outside_read)
        mem = plan_memory(rm, mac, budget, context_tokens)
        hits = hit_rates(mem)
        step = forward_time(rm, mac, hits, constants, context_tokens=context_tokens, prefetch_recall=prefetch_recall)
        plan = RankPlan(r, n, rm.resident_bytes, mem.kv_bytes, mem.cache_bytes, rm.expert_total_bytes, mem.fits,
                        hits.cache, step.total_ms)
        if spec is not None:
            drafter = spec.drafter_bytes if r == 0 else 0
            spec_hits = hit_rates(plan_memory(rm, mac, budget, context_tokens, drafter_bytes=drafter))
            verify_ms = forward_time(rm, mac, spec_hits, constants, n_tokens=window, context_tokens=context_tokens,
                                     unique_expert_scale=spec.unique_expert_scale, prefetch_recall=prefetch_recall,
                                     extra_overlap_ms=draft_ms).total_ms
            if rm.state_bytes or rm.window_tokens:  # rewind by re-running the accepted tokens, as project() does
                from runtime.observe import expected_tokens_per_round

                accepted = max(1, round(expected_tokens_per_round(spec.acceptance_rate, spec.draft_len) - 1))
                rerun = forward_time(rm, mac, HitRates(1.0, 0.0, "re-run"), constants, n_tokens=accepted,
                                     context_tokens=context_tokens)
                verify_ms += (1 - spec.acceptance_rate**spec.draft_len) * rerun.total_ms
            plan = replace(plan, drafter_bytes=drafter, spec_hit_rate=spec_hits.cache, verify_ms=verify_ms)
        ranks.append(plan)
    hops = n_ranks if n_ranks > 1 else 0
    hop_ms = link.hop_ms(hidden_bytes)
    verify_hop_ms = link.hop_ms(window * hidden_bytes)
    plain_ms = sum(r.step_ms for r in ranks) + hops * hop_ms
    spec_tok_s = None
    if spec is not None:
        from runtime.observe import expected_tokens_per_round

        tokens = expected_tokens_per_round(spec.acceptance_rate, spec.draft_len)
        round_ms = draft_ms + sum(r.verify_ms for r in ranks) + hops * verify_hop_ms
        spec_tok_s = 1000.0 * tokens / round_ms
    single_mem = plan_memory(model, mac, budget, context_tokens)
    single_hits = hit_rates(single_mem)
    single = project(model, mac, single_hits, constants, context_tokens=context_tokens, prefetch_recall=prefetch_recall)
    single_spec = None
    if spec is not None:
        spec_hits = hit_rates(plan_memory(model, mac, budget, context_tokens, drafter_bytes=spec.drafter_bytes))
        single_spec = project(model, mac, spec_hits, constants, context_tokens=context_tokens, spec=spec,
                              prefetch_recall=prefetch_recall).tok_per_s
    return PipelinePlan(model.name, mac.name, link.name, n_ranks, tuple(ranks), hop_ms, verify_hop_ms,
                        1000.0 / plain_ms, spec_tok_s, single.tok_per_s, single_spec, single_mem.fits, single_hits.cache)
