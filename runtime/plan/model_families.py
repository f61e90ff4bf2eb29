"""Weight counts per model family, following the module structure of each mlx-lm model file.

`family_weights(model_type, cfg)` turns the language-model fields of an HF-style config.json into a
frozen `Weights` record (weight counts by role, layer and expert counts, KV growth per token, fixed
recurrent state). Families: qwen3_moe, qwen3_next, qwen3_5_moe (+ _text), mixtral, olmoe,
deepseek_v2, deepseek_v3 (same MLA and MoE structure as v2), glm4_moe, gpt_oss.

Invariants: counts are weights, not bytes (model_costs turns them into bytes); "KV per token" counts
only layers whose cache grows with context, sliding-window layers separately with their window, and
fixed state separately; every missing or malformed field raises ValueError naming the field and the
model_type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Weights", "family_weights", "config_int", "SUPPORTED_MODEL_TYPES", "FP16_BYTES", "FP32_BYTES"]

FP16_BYTES = 2
FP32_BYTES = 4
_FP16_BYTES = FP16_BYTES
_FP32_BYTES = FP32_BYTES


@dataclass(frozen=True)
class Weights:
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


def _qwen3_moe(cfg: dict[str, Any], mt: str) -> Weights:
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    n_experts, top_k = _int(cfg, "num_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    moe = _qwen_moe_layers(cfg, mt, n_layers)
    n_moe = sum(moe)
    dense_mlp = (n_layers - n_moe) * 3 * h * _int(cfg, "intermediate_size", mt, 0)
    embedding, lm_head = _embeddings(cfg, mt, h)
    return Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim) + dense_mlp,
        router=n_moe * h * n_experts,
        small=n_layers * (2 * h + 2 * head_dim) + h,
        expert=3 * h * _int(cfg, "moe_intermediate_size", mt), expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_layers * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=True,
    )


def _qwen_hybrid(cfg: dict[str, Any], mt: str) -> Weights:
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
    return Weights(
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


def _mixtral_like(cfg: dict[str, Any], mt: str) -> Weights:
    """mixtral and olmoe: every layer MoE, GQA/MHA attention, no shared expert."""
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    experts_key = "num_local_experts" if mt == "mixtral" else "num_experts"
    n_experts, top_k = _int(cfg, experts_key, mt), _int(cfg, "num_experts_per_tok", mt)
    embedding, lm_head = _embeddings(cfg, mt, h)
    qk_norm = 2 * n_heads * head_dim if mt == "olmoe" else 0  # OLMoE normalises q and k
    return Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim),
        router=n_layers * h * n_experts,
        small=n_layers * (2 * h + qk_norm) + h,
        expert=3 * h * _int(cfg, "intermediate_size", mt), expert_small=0,
        n_layers=n_layers, n_moe_layers=n_layers, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_layers * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=False,
    )


def _deepseek_v2(cfg: dict[str, Any], mt: str) -> Weights:
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
    return Weights(
        embedding=embedding, lm_head=lm_head, quantized=n_layers * attention + shared + dense_mlp,
        router=n_moe * h * n_experts,
        small=n_layers * (2 * h + kv_rank + (q_rank or 0)) + h,
        expert=3 * h * expert_inter, expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        # mlx-lm caches decompressed keys (nope+rope per head) and values, not the MLA latent.
        kv_bytes_per_token=n_layers * n_heads * (q_head + v_dim) * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=False,
    )


def _gpt_oss(cfg: dict[str, Any], mt: str) -> Weights:
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
    return Weights(
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


def _glm4_moe(cfg: dict[str, Any], mt: str) -> Weights:
    """GLM-4.5 / 4.5-Air: GQA with q/k/v bias, dense first layers, one shared expert, a float MoEGate."""
    h, n_layers = _int(cfg, "hidden_size", mt), _int(cfg, "num_hidden_layers", mt)
    n_heads, n_kv = _int(cfg, "num_attention_heads", mt), _int(cfg, "num_key_value_heads", mt)
    head_dim = _int(cfg, "head_dim", mt, h // n_heads)
    n_moe = n_layers - min(n_layers, _int(cfg, "first_k_dense_replace", mt, 0))
    expert_inter = _int(cfg, "moe_intermediate_size", mt)
    shared = n_moe * 3 * h * expert_inter * _int(cfg, "n_shared_experts", mt, 0)
    dense_mlp = (n_layers - n_moe) * 3 * h * _int(cfg, "intermediate_size", mt)
    n_experts, top_k = _int(cfg, "n_routed_experts", mt), _int(cfg, "num_experts_per_tok", mt)
    qkv_bias = (n_heads + 2 * n_kv) * head_dim if cfg.get("attention_bias") else 0
    qk_norm = 2 * head_dim if cfg.get("use_qk_norm") else 0
    embedding, lm_head = _embeddings(cfg, mt, h)
    return Weights(
        embedding=embedding, lm_head=lm_head,
        quantized=n_layers * _gqa_attention(h, n_heads, n_kv, head_dim) + shared + dense_mlp,
        router=n_moe * h * n_experts,
        small=n_layers * (2 * h + qkv_bias + qk_norm) + n_moe * n_experts + h,  # + the gate's correction bias
        expert=3 * h * expert_inter, expert_small=0,
        n_layers=n_layers, n_moe_layers=n_moe, n_experts=n_experts, top_k=top_k,
        kv_bytes_per_token=n_layers * 2 * n_kv * head_dim * _FP16_BYTES,
        window_kv_bytes_per_token=0, window_tokens=0, state_bytes=0, router_8bit=False,
    )


def config_int(cfg: dict[str, Any], key: str, model_type: str, default: Any = ...) -> int:
    """A non-negative int field of a config (see _int)."""
    return _int(cfg, key, model_type, default)


def family_weights(model_type: str, cfg: dict[str, Any]) -> Weights:
    """Weight counts of a model of `model_type` from its language-model config fields."""
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; "
            f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family(cfg, model_type)


_FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen_hybrid,
    "qwen3_5_moe": _qwen_hybrid,
    "qwen3_5_moe_text": _qwen_hybrid,
    "mixtral": _mixtral_like,
    "olmoe": _mixtral_like,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v2,  # same MLA attention, dense first layers and shared experts; router + correction bias
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


