"""MemoryLimit: one cap on the process's memory, and what it leaves for the expert cache.

The cap (`--memory-limit`) covers everything the process holds:
    baseline      the interpreter and libraries, measured (RSS) before the model loads, and again
                  after it (the process beside weights and cache slabs: tokenizer, allocator pools)
    resident      the non-expert weights
    drafter       the drafter's weights (speculative decoding)
    kv            the KV cache and recurrent state, which grow with the context
    activations   a prefill chunk's transient arrays (attention scores dominate on long contexts)
    slack         allocator and page-cache slack: 5% of the cap
    expert cache  what is left, never below one token's experts (top-k slots per layer)
`expert_room(kv_bytes)` is that remainder; the budget planned at load uses the KV of the context
expected then, and as the KV grows past it `ContextGovernor` asks the ExpertCache for fewer
usable slots, whose pages go back to the OS where that is possible (Linux; see
ExpertCache.release_pages), so the process stays under the cap instead of swapping.
`prefill_step(...)` picks the prompt chunk: mlx-lm's 2048 tokens unless the activations of such a
chunk at that context would not fit their share; long prompts are cut only then.

"auto" (the default) is the `--budget auto` rule: the smallest of RAM, the Linux cgroup's memory limit
(runtime/cache/cgroup_memory.py) and (on Metal) the GPU's recommended working set, less the headroom
(runtime/cache/budget.py).

Invariants: pure accounting, no I/O (the caller measures baseline and KV); a limit that cannot
hold baseline + resident + drafter + KV + activations + one token's experts is refused with a
one-line message naming --memory-limit and the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.cache.budget import format_bytes, parse_budget

DEFAULT_PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size
SLACK_FRACTION = 0.05
ACTIVATION_SHARE = 0.25  # of what is left after weights and KV, the most a prefill chunk may take


def parse_memory_limit(text: str | None) -> int | None:
    """Bytes of a --memory-limit like 12GB; None for auto (or None)."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    try:
        spec = parse_budget(text)
    except ValueError:
        spec = None
    if spec is None or spec.kind != "bytes":
        raise ValueError(f"--memory-limit {text!r}: expected a size like 12GB or 900MiB, or auto")
    return int(spec.value)


def activation_bytes(config: dict, chunk: int, context: int) -> int:
    """Transient bytes of one prefill chunk of `chunk` tokens at `context` tokens (float32 upper bound):
    attention scores and their softmax (chunk x context x heads, twice), the MoE pairs' hidden
    activations, and a dozen hidden-sized arrays per token."""
    cfg = config.get("text_config", config)
    heads = int(cfg.get("num_attention_heads", 1))
    hidden = int(cfg.get("hidden_size", 0))
    k = int(cfg.get("num_experts_per_tok", 1))
    moe_hidden = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or hidden)
    per_token = 2 * context * heads + k * (3 * moe_hidden + 2 * hidden) + 12 * hidden
    return 4 * chunk * per_token


@dataclass(frozen=True)
class MemoryLimit:
    limit_bytes: int  # the cap on the whole process
    baseline_bytes: int  # the process before the model (interpreter, libraries)
    resident_bytes: int  # non-expert weights
    drafter_bytes: int = 0  # drafter weights

    def remeasured(self, rss_bytes: int, weights_bytes: int) -> "MemoryLimit":
        """After loading: the process beside the weights and the cache slabs (`rss_bytes - weights_bytes`:
        the tokenizer, allocator pools, threads) becomes the baseline if it is larger than the one measured
        before, so the governor's room is what the process really has."""
        from dataclasses import replace

        return replace(self, baseline_bytes=max(self.baseline_bytes, rss_bytes - weights_bytes))

    @property
    def slack_bytes(self) -> int:
        return int(SLACK_FRACTION * self.limit_bytes)

    def free_for_context(self, kv_bytes: int) -> int:
        """What the cap leaves for activations and experts beside the fixed parts and `kv_bytes`."""
        return self.limit_bytes - self.baseline_bytes - self.resident_bytes - self.drafter_bytes - kv_bytes - self.slack_bytes

    def prefill_step(self, config: dict, context: int, kv_bytes: int, default: int = DEFAULT_PREFILL_STEP) -> int:
        """The prompt chunk: `default` unless its activations at `context` exceed their share; then the
        largest that fits (at least 16 tokens)."""
        share = ACTIVATION_SHARE * self.free_for_context(kv_bytes)
        step = default
        while step > 16 and activation_bytes(config, min(step, max(1, context)), context) > share:
            step //= 2
        return max(16, step)

    def expert_room(self, config: dict, kv_bytes: int, context: int, step: int) -> int:
        """Bytes the cap leaves for the expert cache at `kv_bytes` of KV, prefilling in chunks of `step`."""
        return self.free_for_context(kv_bytes) - activation_bytes(config, min(step, max(1, context)), context)

    def check(self, room: int, min_cache_bytes: int) -> None:
        if room < min_cache_bytes:
            need = self.limit_bytes - room + min_cache_bytes
            raise ValueError(
                f"--memory-limit {format_bytes(self.limit_bytes)} leaves {format_bytes(max(0, room))} for experts; "
                f"one token's experts need {format_bytes(min_cache_bytes)}: the minimum here is about {format_bytes(need)} "
                f"(baseline {format_bytes(self.baseline_bytes)}, resident {format_bytes(self.resident_bytes)}, "
                f"drafter {format_bytes(self.drafter_bytes)}, KV and activations the rest)")


def auto_limit_bytes() -> int:
    """The auto rule's memory: the smallest of RAM, the cgroup's limit and (on Metal) the GPU's recommended
    working set."""
    from runtime.cache.budget import metal_working_set_bytes
    from runtime.cache.cgroup_memory import system_memory_bytes

    ram = system_memory_bytes()
    ws = metal_working_set_bytes()
    return min(ram, ws) if ws else ram


def limit_plan(plan, limit: MemoryLimit, config: dict, *, context_tokens: int, kv_bytes: int,
               expert_bytes: dict[int, int], n_experts: dict[int, int], top_k: int):
    """`plan` (a BudgetPlan) shrunk to what `limit` leaves for experts at `context_tokens`; refuses a limit
    too small for one token's experts. Returns (plan, prefill step)."""
    from runtime.cache.budget import BudgetSpec, plan_budget

    step = limit.prefill_step(config, context_tokens, kv_bytes)
    room = limit.expert_room(config, kv_bytes, context_tokens, step)
    limit.check(room, plan.min_bytes)
    if room >= plan.budget_bytes:
        return plan, step
    spec = BudgetSpec("bytes", float(room), f"{format_bytes(room)} (--memory-limit)")
    smaller = plan_budget(spec, expert_bytes=expert_bytes, n_experts=n_experts, top_k=top_k, resident_bytes=0, kv_bytes=0)
    breakdown = {**plan.breakdown, "memory_limit": limit.limit_bytes, "baseline": limit.baseline_bytes,
                 "kv_at_context": kv_bytes, "left_for_experts": room}
    return type(plan)(smaller.budget_bytes, smaller.slots, smaller.min_bytes, smaller.expert_bytes_total, breakdown), step


def process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


_peak_seen = 0  # the largest interval peak rss_peak_since_last() has read (the process's peak across its resets)


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_peak_since_last() -> int:
    """The process's peak RSS since the previous call (Linux: the kernel's high-water mark VmHWM, then reset
    through /proc/self/clear_refs), so transients between two calls -- a prefill chunk's arrays, a KV cache
    growing by concatenation -- count, not only the RSS at the moment. Elsewhere the current RSS."""
    global _peak_seen
    hwm = _vm_hwm()
    if hwm is None:
        return process_rss()
    _peak_seen = max(_peak_seen, hwm)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    return hwm


def process_peak_rss() -> int:
    """The process's peak RSS over its life, across rss_peak_since_last()'s resets."""
    hwm = _vm_hwm()
    if hwm is None:
        import resource
        import sys

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb if sys.platform == "darwin" else kb * 1024
    return max(_peak_seen, hwm)


def apply_memory_limit(plan, text: str, *, config: dict, layouts: dict, resident_bytes: int, context_tokens: int,
                       drafter_bytes: int, top_k: int, baseline_bytes: int):
    """The load-time side of --memory-limit: (plan within the limit, the MemoryLimit, the prefill step,
    KV bytes per token)."""
    from runtime.cache.budget import kv_bytes_estimate

    limit_bytes = parse_memory_limit(text)
    limit = MemoryLimit(limit_bytes if limit_bytes is not None else auto_limit_bytes(), baseline_bytes,
                        resident_bytes, drafter_bytes)
    first = layouts[min(layouts)]
    value_bytes = 4 if any(t.dtype == "F32" for t in first.tensors) else 2  # activations follow the scales' dtype
    kv = kv_bytes_estimate(config, context_tokens, bytes_per_value=value_bytes)
    plan, step = limit_plan(plan, limit, config, context_tokens=context_tokens, kv_bytes=kv,
                            expert_bytes={l: lay.expert_bytes for l, lay in layouts.items()},
                            n_experts={l: lay.n_experts for l, lay in layouts.items()}, top_k=top_k)
    return plan, limit, step, kv_bytes_estimate(config, 1, bytes_per_value=value_bytes)
