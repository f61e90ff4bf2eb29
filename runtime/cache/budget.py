"""Memory budgets for the expert cache: parsing, `auto`, and slots per layer.

`--budget` accepts a size ("6GB", "512MiB", "1.5G"), a share of the model's
expert bytes ("40%"), or "auto": the smallest of total RAM, the memory limit of the
process's Linux cgroup (runtime/cache/cgroup_memory.py) and (on Metal) the GPU's
recommended working set, minus resident weights, the KV cache at a context length
and headroom. Slots are split equally across MoE layers.

Invariants: every layer gets at least top_k slots (one token's experts) or the
budget is refused with the minimum in the message; no layer gets more slots than
it has experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import psutil

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1024, "M": 1e6, "MB": 1e6, "MIB": 1024**2,
          "G": 1e9, "GB": 1e9, "GIB": 1024**3, "T": 1e12, "TB": 1e12, "TIB": 1024**4}
HEADROOM_FRACTION = 0.15  # of usable memory kept free for activations, the OS and the drafter
HEADROOM_MIN_BYTES = 512 * 1024**2


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class BudgetSpec:
    kind: str  # "bytes", "fraction" or "auto"
    value: float  # bytes, or a fraction in (0, 1]; 0 for auto
    text: str  # what the user wrote


def parse_budget(text: str) -> BudgetSpec:
    s = str(text).strip()
    if s.lower() == "auto":
        return BudgetSpec("auto", 0.0, s)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if m:
        frac = float(m.group(1)) / 100
        if not 0 < frac <= 1:
            raise ValueError(f"--budget {s!r}: a percentage must be in (0%, 100%]")
        return BudgetSpec("fraction", frac, s)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", s)
    if m and m.group(2).upper() in _UNITS:
        n = float(m.group(1)) * _UNITS[m.group(2).upper()]
        if n <= 0:
            raise ValueError(f"--budget {s!r} must be positive")
        return BudgetSpec("bytes", n, s)
    raise ValueError(f"--budget {s!r}: expected a size like 6GB or 512MiB, a share like 40%, or auto")


def metal_working_set_bytes() -> int | None:
    """The GPU's recommended working set on Apple silicon; None elsewhere."""
    import mlx.core as mx

    try:
        if not mx.metal.is_available():
            return None
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return None
    value = info.get("max_recommended_working_set_size")
    return int(value) if value else None


def kv_bytes_estimate(config: dict, context_tokens: int, bytes_per_value: int = 2) -> int:
    """KV-cache bytes for `context_tokens` (attention layers only for hybrids; sliding-window layers
    capped at their window; DeepSeek MLA as mlx-lm caches it: decompressed keys and values per head)."""
    cfg = config.get("text_config", config)
    layers = int(cfg.get("num_hidden_layers", 0))
    if cfg.get("kv_lora_rank"):
        per_head = int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0)) + int(cfg.get("v_head_dim", 0))
        return layers * int(cfg.get("num_attention_heads", 0)) * per_head * context_tokens * bytes_per_value
    interval = cfg.get("full_attention_interval")
    if interval:
        layers = layers // int(interval)
    heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 0))
    head_dim = int(cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(1, int(cfg.get("num_attention_heads", 1))))
    per_layer = 2 * heads * head_dim * bytes_per_value
    window = cfg.get("sliding_window")
    if window and isinstance(cfg.get("layer_types"), list):  # gpt-oss: alternating sliding / full attention
        sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
        return per_layer * ((layers - sliding) * context_tokens + sliding * min(context_tokens, int(window)))
    return layers * per_layer * context_tokens


@dataclass(frozen=True)
class BudgetPlan:
    budget_bytes: int  # bytes granted to the expert cache
    slots: dict[int, int]  # MoE layer -> slots
    min_bytes: int  # the smallest budget that runs (top_k slots per layer)
    expert_bytes_total: int  # all routed experts of the model
    breakdown: dict[str, int] = field(default_factory=dict)  # how `auto` was computed

    @property
    def cache_bytes(self) -> int:
        return self.budget_bytes

    @property
    def fraction(self) -> float:
        return self.budget_bytes / self.expert_bytes_total


def plan_budget(spec: BudgetSpec, *, expert_bytes: dict[int, int], n_experts: dict[int, int], top_k: int,
                resident_bytes: int, kv_bytes: int, total_memory_bytes: int | None = None,
                working_set_bytes: int | None = None, cgroup_bytes: int | None = None) -> BudgetPlan:
    """Turn a budget into slots per layer. expert_bytes/n_experts are per MoE layer. For `auto`, RAM and
    the cgroup limit are read from the system unless given (a given RAM is not capped by the real cgroup)."""
    total = sum(expert_bytes[l] * n_experts[l] for l in expert_bytes)
    per_slot_row = sum(expert_bytes.values())  # one slot in every layer
    min_bytes = top_k * per_slot_row
    breakdown: dict[str, int] = {}
    if spec.kind == "fraction":
        budget = int(spec.value * total)
    elif spec.kind == "bytes":
        budget = int(spec.value)
    else:
        if total_memory_bytes is None:
            from runtime.cache.cgroup_memory import cgroup_limit_bytes

            total_memory_bytes = psutil.virtual_memory().total
            cgroup_bytes = cgroup_bytes or cgroup_limit_bytes()
        ram = total_memory_bytes
        ws = working_set_bytes if working_set_bytes is not None else metal_working_set_bytes()
        usable = min(x for x in (ram, ws, cgroup_bytes) if x)
        headroom = max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * usable))
        budget = usable - resident_bytes - kv_bytes - headroom
        breakdown = {"memory": ram, "metal_working_set": ws or 0, "cgroup_limit": cgroup_bytes or 0, "usable": usable,
                     "resident_weights": resident_bytes, "kv_cache": kv_bytes, "headroom": headroom,
                     "left_for_experts": budget}
    if budget < min_bytes:
        raise ValueError(
            f"--budget {spec.text} gives {format_bytes(budget)} for experts; the minimum is "
            f"{format_bytes(min_bytes)} ({top_k} experts per MoE layer x {len(expert_bytes)} layers)"
        )
    n_slots = max(top_k, int(budget // per_slot_row))
    slots = {l: min(n_experts[l], n_slots) for l in expert_bytes}
    used = sum(slots[l] * expert_bytes[l] for l in slots)
    return BudgetPlan(used, slots, min_bytes, total, breakdown)
