"""Model costs: bytes per expert, resident bytes and KV bytes computed from a config.json dict.

`model_costs(config, bits=4)` turns an HF-style config (a local file or a preset from
`data/model_presets.json`) into a frozen `ModelCosts`: what stays resident, what pages, what one
token reads. Weight counts follow the module structure of the mlx-lm model files for each family
(qwen3_moe, qwen3_next, qwen3_5_moe with its config nested under text_config, mixtral,
deepseek_v2, olmoe, gpt_oss); bytes follow mlx affine quantization.

Invariants:
- Quantized weights cost bits/8 + 4/group_size bytes each (an fp16 scale and an fp16 bias per
  group): 4-bit group 64 -> 0.5625 bytes/weight. Routers of qwen3*/gpt_oss stay 8-bit, as
  mlx-lm's quant_predicate keeps them; norms, biases, conv kernels and sinks stay 16-bit.
- "Resident" is everything except routed experts; shared experts are resident.
- One decode token reads the resident weights except the embedding table (one row of it) plus
  top_k experts in every MoE layer; KV reads are counted separately at a context length.
- Every missing or malformed field raises ValueError naming the field and the model_type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "ModelCosts",
    "affine_bytes_per_weight",
    "model_costs",
    "load_model_config",
    "preset_names",
    "SUPPORTED_MODEL_TYPES",
]

_PRESETS_PATH = Path(__file__).parent.parent / "data" / "model_presets.json"
_FP16_BYTES = 2
_FP32_BYTES = 4
_VALID_BITS = (2, 3, 4, 5, 6, 8, 16)
_VALID_GROUPS = (32, 64, 128)


def affine_bytes_per_weight(bits: int, group_size: int = 64) -> float:
    """Bytes per weight of mlx affine quantization; bits=16 means unquantized fp16/bf16."""
    if bits not in _VALID_BITS:
        raise ValueError(f"--bits must be one of {_VALID_BITS}, got {bits!r}")
    if bits == 16:
        return float(_FP16_BYTES)
    if group_size not in _VALID_GROUPS:
        raise ValueError(f"--group-size must be one of {_VALID_GROUPS}, got {group_size!r}")
    return bits / 8 + 2 * _FP16_BYTES / group_size


@dataclass(frozen=True)
class _Weights:
    """Weight counts by role for a whole model (before quantization)."""

    embedding: int  # token embedding table
    lm_head: int  # output projection (0 when tied to the embedding)
    quantized: int  # attention / linear-attention projections, dense MLPs, shared experts
    router: int  # router (+ shared-expert gate) weights
    small: int  # norms, biases, conv kernels, sinks: kept 16-bit
    expert: int  # matrix weights of ONE routed expert
    expert_small: int  # 16-bit biases of ONE routed expert (gpt_oss)
    n_layers: int  # decoder layers
    n_moe_layers: int  # layers with routed experts
    n_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token (config default)
    kv_bytes_per_token: int  # KV of layers whose cache grows with context
    window_kv_bytes_per_token: int  # KV of sliding-window layers (capped at window_tokens)
    window_tokens: int  # sliding-window length (0 when none)
    state_bytes: int  # fixed recurrent state (linear attention), independent of context
    router_8bit: bool  # mlx-lm keeps this family's router at 8 bits


@dataclass(frozen=True)
class ModelCosts:
    name: str  # display name (preset name or config path)
    model_type: str  # config model_type the numbers were computed for
    bits: int  # quantization bits of the weights (16 = unquantized)
    group_size: int  # quantization group size
    n_layers: int  # decoder layers
    n_moe_layers: int  # layers with routed experts
    n_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts read per token per MoE layer
    hidden_size: int  # model width
    expert_params: int  # matrix weights of one routed expert (for the compute roofline)
    expert_bytes: int  # bytes of one routed expert (all its matrices, scales, biases)
    expert_total_bytes: int  # bytes of all routed experts in the model
    resident_bytes: int  # bytes of everything else (always in memory)
    resident_read_bytes_per_token: int  # resident bytes one decode token reads (embedding: one row)
    kv_bytes_per_token: int  # growing KV cache per context token (all layers)
    window_kv_bytes_per_token: int  # sliding-window KV per token, capped at window_tokens
    window_tokens: int  # sliding window length (0 when none)
    state_bytes: int  # fixed recurrent state of linear-attention layers
    active_params_per_token: int  # weights one token multiplies (for the compute roofline)

    @property
    def experts_read_per_token(self) -> int:
        """Routed experts one decode token reads: top_k in every MoE layer."""
        return self.top_k * self.n_moe_layers

    @property
    def expert_bytes_per_token(self) -> int:
        """Routed-expert bytes one token reads when every expert misses."""
        return self.experts_read_per_token * self.expert_bytes

    def kv_bytes(self, context_tokens: int) -> int:
        """KV cache + recurrent state bytes at `context_tokens` of context."""
        if context_tokens < 0:
            raise ValueError(f"--context must be >= 0, got {context_tokens!r}")
        window = min(context_tokens, self.window_tokens)
        return self.kv_bytes_per_token * context_tokens + self.window_kv_bytes_per_token * window + self.state_bytes


def _int(cfg: dict[str, Any], key: str, model_type: str, default: Any = ...) -> int:
    """A non-negative int field; a missing (or null) field falls back to `default` or raises."""
    value = cfg.get(key)
    if value is None and default is ...:
        raise ValueError(f"config.json: missing field {key!r} required for model_type {model_type!r}")
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: field {key!r} must be a non-negative int, got {value!r}")
    return value


def _gqa_attention(h: int, n_heads: int, n_kv: int, head_dim: int, gated_q: bool = False) -> int:
    q_out = n_heads * head_dim * (2 if gated_q else 1)  # Qwen3-Next/3.5 gate doubles q_proj
    return h * q_out + 2 * h * n_kv * head_dim + n_heads * head_dim * h


def _embeddings(cfg: dict[str, Any], mt: str, h: int) -> tuple[int, int]:
    vocab = _int(cfg, "vocab_size", mt)
    tied = bool(cfg.get("tie_word_embeddings", False))
    return vocab * h, 0 if tied else vocab * h


def _qwen_moe_layers(cfg: dict[str, Any], mt: str, n_layers: int) -> list[bool]:
    step = _int(cfg, "decoder_sparse_step", mt, 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return [l not in dense_only and (l + 1) % step == 0 for l in range(n_layers)]


def _qwen3_moe(cfg: dict[str, Any], mt: str) -> _Weights:
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    n_experts, top_k = _int(cfg, "num_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    moe = _qwen_moe_layers(cfg, mt, n_layers)
    n_moe = sum(moe)
    dense_mlp = (n_layers - n_moe) * 3 * h * _int(cfg, "intermediate_size", mt, 0)
    embedding, lm_head = _embeddings(cfg, mt, h)
    return _Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim) + dense_mlp,
        router=n_moe * h * n_experts,
        small=n_layers * (2 * h + 2 * head_dim) + h,
        expert=3 * h * _int(cfg, "moe_intermediate_size", mt), expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_layers * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=True,
    )


def _qwen_hybrid(cfg: dict[str, Any], mt: str) -> _Weights:
    """qwen3_next and qwen3_5_moe: Gated DeltaNet layers with a full-attention layer every N."""
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    interval = _int(cfg, "full_attention_interval", mt, 4)
    layer_types = cfg.get("layer_types")
    if layer_types:
        full = [kind == "full_attention" for kind in layer_types]
    else:
        full = [(l + 1) % interval == 0 for l in range(n_layers)]
    n_full = sum(full)
    n_linear = n_layers - n_full
    k_head_dim = _int(cfg, "linear_key_head_dim", mt)
    key_dim = _int(cfg, "linear_num_key_heads", mt) * k_head_dim
    n_v_heads = _int(cfg, "linear_num_value_heads", mt)
    v_head_dim = _int(cfg, "linear_value_head_dim", mt)
    value_dim = n_v_heads * v_head_dim
    kernel = _int(cfg, "linear_conv_kernel_dim", mt, 4)
    conv_dim = 2 * key_dim + value_dim
    # in_proj q,k,v,z plus the per-head beta/alpha projections, then out_proj.
    linear_attention = h * (2 * key_dim + 2 * value_dim + 2 * n_v_heads) + value_dim * h
    n_experts, top_k = _int(cfg, "num_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    moe = _qwen_moe_layers(cfg, mt, n_layers)
    n_moe = sum(moe)
    shared = n_moe * 3 * h * _int(cfg, "shared_expert_intermediate_size", mt, 0)
    dense_mlp = (n_layers - n_moe) * 3 * h * _int(cfg, "intermediate_size", mt, 0)
    embedding, lm_head = _embeddings(cfg, mt, h)
    return _Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_full * _gqa_attention(h, n_heads, n_kv, head_dim, gated_q=True)
        + n_linear * linear_attention + shared + dense_mlp,
        router=n_moe * h * (n_experts + 1),  # +1: the shared-expert gate, also 8-bit
        small=n_layers * 2 * h + n_full * 2 * head_dim
        + n_linear * (conv_dim * kernel + 2 * n_v_heads + v_head_dim) + h,
        expert=3 * h * _int(cfg, "moe_intermediate_size", mt), expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_full * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0,
        # Recurrent state is fp32 (n_v_heads x v_dim x k_dim); the conv state keeps kernel-1 inputs.
        state_bytes=n_linear * (
            n_v_heads * v_head_dim * k_head_dim * _FP32_BYTES
            + (kernel - 1) * conv_dim * _FP16_BYTES
        ),
        router_8bit=True,
    )


def _mixtral_like(cfg: dict[str, Any], mt: str) -> _Weights:
    """mixtral and olmoe: every layer MoE, GQA/MHA attention, no shared expert."""
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    experts_key = "num_local_experts" if mt == "mixtral" else "num_experts"
    n_experts, top_k = _int(cfg, experts_key, mt), _int(cfg, "num_experts_per_tok", mt)
    embedding, lm_head = _embeddings(cfg, mt, h)
    qk_norm = 2 * n_heads * head_dim if mt == "olmoe" else 0  # OLMoE normalises q and k
    return _Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim),
        router=n_layers * h * n_experts,
        small=n_layers * (2 * h + qk_norm) + h,
        expert=3 * h * _int(cfg, "intermediate_size", mt), expert_small=0,
        n_layers=n_layers, n_moe_layers=n_layers, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_layers * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=False,
    )


def _deepseek_v2(cfg: dict[str, Any], mt: str) -> _Weights:
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads = _int(cfg, "num_attention_heads", mt)
    nope, rope = _int(cfg, "qk_nope_head_dim", mt), _int(cfg, "qk_rope_head_dim", mt)
    v_dim, kv_rank = _int(cfg, "v_head_dim", mt), _int(cfg, "kv_lora_rank", mt)
    q_rank = cfg.get("q_lora_rank")
    q_head = nope + rope
    q_proj = h * n_heads * q_head if not q_rank else h * q_rank + q_rank * n_heads * q_head
    attention = q_proj + h * (kv_rank + rope) + kv_rank * n_heads * (nope + v_dim) + n_heads * v_dim * h
    first_dense = _int(cfg, "first_k_dense_replace", mt, 0)
    freq = _int(cfg, "moe_layer_freq", mt, 1) or 1
    moe = [l >= first_dense and l % freq == 0 for l in range(n_layers)]
    n_moe = sum(moe)
    expert_inter = _int(cfg, "moe_intermediate_size", mt)
    shared = n_moe * 3 * h * expert_inter * _int(cfg, "n_shared_experts", mt, 0)
    dense_mlp = (n_layers - n_moe) * 3 * h * _int(cfg, "intermediate_size", mt)
    n_experts, top_k = _int(cfg, "n_routed_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    embedding, lm_head = _embeddings(cfg, mt, h)
    return _Weights(
        embedding=embedding, lm_head=lm_head, quantized=n_layers * attention + shared + dense_mlp,
        router=n_moe * h * n_experts,
        small=n_layers * (2 * h + kv_rank + (q_rank or 0)) + h,
        expert=3 * h * expert_inter, expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        # mlx-lm caches decompressed keys (nope+rope per head) and values, not the MLA latent.
        kv_bytes_per_token=n_layers * n_heads * (q_head + v_dim) * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=False,
    )


def _gpt_oss(cfg: dict[str, Any], mt: str) -> _Weights:
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    inter = _int(cfg, "intermediate_size", mt)
    n_experts, top_k = _int(cfg, "num_local_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if l % 2 == 0 else "full_attention" for l in range(n_layers)
    ]
    n_sliding = sum(kind == "sliding_attention" for kind in layer_types)
    per_layer_kv = 2 * n_kv * head_dim * _FP16_BYTES
    embedding, lm_head = _embeddings(cfg, mt, h)
    attention_bias = n_heads * head_dim + 2 * n_kv * head_dim + h
    return _Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim),
        router=n_layers * h * n_experts,
        small=n_layers * (2 * h + attention_bias + n_heads + n_experts) + h,
        expert=3 * h * inter, expert_small=2 * inter + h,  # gate/up/down biases
        n_layers=n_layers, n_moe_layers=n_layers, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=(n_layers - n_sliding) * per_layer_kv,
        window_kv_bytes_per_token=n_sliding * per_layer_kv,
        window_tokens=_int(cfg, "sliding_window", mt, 128), state_bytes=0, router_8bit=True,
    )


_FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen_hybrid,
    "qwen3_5_moe": _qwen_hybrid,
    "qwen3_5_moe_text": _qwen_hybrid,
    "mixtral": _mixtral_like,
    "olmoe": _mixtral_like,
    "deepseek_v2": _deepseek_v2,
    "gpt_oss": _gpt_oss,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def _text_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, the dict holding the language-model fields); Qwen3.5 nests them in text_config."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    text = config.get("text_config")
    if isinstance(text, dict):
        model_type = model_type or text.get("model_type")
        return str(model_type), text
    if model_type is None:
        raise ValueError("config.json: missing field 'model_type'")
    return str(model_type), config


def model_costs(
    config: dict[str, Any],
    bits: int = 4,
    group_size: int = 64,
    top_k: int | None = None,
    name: str = "",
) -> ModelCosts:
    """Costs of `config` at mlx affine `bits`/`group_size`; `top_k` overrides experts per token."""
    model_type, cfg = _text_config(config)
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; "
            f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    weights = family(cfg, model_type)
    per_weight = affine_bytes_per_weight(bits, group_size)
    router_per_weight = affine_bytes_per_weight(8, 64) if weights.router_8bit and bits < 16 else per_weight
    k = weights.top_k if top_k is None else top_k
    if not isinstance(k, int) or not 1 <= k <= weights.n_experts:
        raise ValueError(f"--top-k must be an int in [1, {weights.n_experts}], got {top_k!r}")
    expert_bytes = round(weights.expert * per_weight + weights.expert_small * _FP16_BYTES)
    embedding_bytes = weights.embedding * per_weight
    resident = (
        (weights.embedding + weights.lm_head + weights.quantized) * per_weight
        + weights.router * router_per_weight
        + weights.small * _FP16_BYTES
    )
    hidden = _int(cfg, "hidden_size", model_type)
    # Untied: decode touches one embedding row. Tied: the table is also the output head, read whole.
    read = resident if weights.lm_head == 0 else resident - embedding_bytes + hidden * per_weight
    non_embedding_params = weights.lm_head + weights.quantized + weights.router + weights.small
    return ModelCosts(
        name=name or model_type,
        model_type=model_type,
        bits=bits,
        group_size=group_size,
        n_layers=weights.n_layers,
        n_moe_layers=weights.n_moe_layers,
        n_experts=weights.n_experts,
        top_k=k,
        hidden_size=hidden,
        expert_params=weights.expert,
        expert_bytes=expert_bytes,
        expert_total_bytes=expert_bytes * weights.n_experts * weights.n_moe_layers,
        resident_bytes=round(resident),
        resident_read_bytes_per_token=round(read),
        kv_bytes_per_token=weights.kv_bytes_per_token,
        window_kv_bytes_per_token=weights.window_kv_bytes_per_token,
        window_tokens=weights.window_tokens,
        state_bytes=weights.state_bytes,
        active_params_per_token=non_embedding_params + k * weights.n_moe_layers * weights.expert,
    )


@lru_cache(maxsize=1)
def _presets() -> dict[str, Any]:
    with open(_PRESETS_PATH, encoding="utf-8") as handle:
        return json.load(handle)


def preset_names() -> list[str]:
    """Canonical preset names (aliases excluded)."""
    return sorted(_presets()["presets"])


def preset(name: str) -> dict[str, Any]:
    """The preset record (display_name, source, reference, config) for a name or alias."""
    key = name.strip().lower()
    key = _presets()["aliases"].get(key, key)
    try:
        return _presets()["presets"][key]
    except KeyError:
        raise ValueError(
            f"--model {name!r} is neither a preset ({', '.join(preset_names())}) "
            f"nor an existing config.json path"
        ) from None


def hit_rate_observations() -> list[dict[str, Any]]:
    """Published (cache_fraction, hit_rate) points with their sources."""
    return list(_presets()["hit_rate_observations"]["points"])


def load_model_config(name_or_path: str) -> tuple[str, dict[str, Any], str]:
    """(display name, config dict, source) for a preset name or a config.json file/directory."""
    path = Path(name_or_path).expanduser()
    looks_like_path = path.suffix == ".json" or "/" in name_or_path or path.exists()
    if not looks_like_path:
        record = preset(name_or_path)
        return record["display_name"], record["config"], record["source"]
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {name_or_path!r}: no such file {str(path)!r} (expected a config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {str(path)!r} is not a readable JSON config: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    return path.parent.name or str(path), config, str(path)
