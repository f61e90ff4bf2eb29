"""Model costs: bytes per expert, resident bytes and KV bytes computed from a config.json dict.

`model_costs(config, bits=4)` turns an HF-style config (a local file or a preset from
`data/model_presets.json`, see model_presets.py) into a frozen `ModelCosts`: what stays resident,
what pages, what one token reads. Weight counts come from model_families.py; bytes follow mlx
quantization: affine (the default) or a microscaled mode (mxfp4, nvfp4, mxfp8).

Invariants:
- Quantized weights cost bits/8 + 4/group_size bytes each (an fp16 scale and an fp16 bias per
  group): 4-bit group 64 -> 0.5625 bytes/weight. Microscaled modes fix bits and group and keep one
  uint8 scale per group, no bias: mxfp4 -> 0.53125, nvfp4 -> 0.5625, mxfp8 -> 1.03125 (as
  mx.quantize lays them out; tests/test_planner.py checks against it). A config.json's own
  `quantization` block gives bits, group size and mode when the caller does not. Routers of qwen3*/gpt_oss stay 8-bit, as
  mlx-lm's quant_predicate keeps them; norms, biases, conv kernels and sinks stay 16-bit.
- "Resident" is everything except routed experts; shared experts are resident.
- One decode token reads the resident weights except the embedding table (one row of it) plus
  top_k experts in every MoE layer; KV reads are counted separately at a context length.
- Every missing or malformed field raises ValueError naming the field and the model_type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.plan.model_families import FP16_BYTES, SUPPORTED_MODEL_TYPES, config_int, family_weights

__all__ = ["ModelCosts", "QUANT_MODES", "affine_bytes_per_weight", "bytes_per_weight", "config_quantization",
           "model_costs", "text_config", "SUPPORTED_MODEL_TYPES"]

_FP16_BYTES = FP16_BYTES
_VALID_BITS = (2, 3, 4, 5, 6, 8, 16)
_VALID_GROUPS = (32, 64, 128)
# mlx's microscaled modes: (bits, group size); each group has one uint8 scale and no bias.
_MICROSCALED = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
QUANT_MODES = ("affine", *_MICROSCALED)


def affine_bytes_per_weight(bits: int, group_size: int = 64) -> float:
    """Bytes per weight of mlx affine quantization; bits=16 means unquantized fp16/bf16."""
    if bits not in _VALID_BITS:
        raise ValueError(f"--bits must be one of {_VALID_BITS}, got {bits!r}")
    if bits == 16:
        return float(_FP16_BYTES)
    if group_size not in _VALID_GROUPS:
        raise ValueError(f"--group-size must be one of {_VALID_GROUPS}, got {group_size!r}")
    return bits / 8 + 2 * _FP16_BYTES / group_size


def bytes_per_weight(bits: int, group_size: int = 64, mode: str = "affine") -> float:
    """Bytes per weight in mlx quantization `mode`; microscaled modes ignore bits/group_size (fixed)."""
    if mode == "affine":
        return affine_bytes_per_weight(bits, group_size)
    if mode not in _MICROSCALED:
        raise ValueError(f"--quant-mode must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    mode_bits, group = _MICROSCALED[mode]
    return mode_bits / 8 + 1 / group


def config_quantization(config: dict[str, Any]) -> tuple[int, int, str] | None:
    """(bits, group_size, mode) of an mlx-lm checkpoint's config.json `quantization`, or None when
    it has none (an unquantized or upstream config)."""
    quant = config.get("quantization") if isinstance(config, dict) else None
    if not isinstance(quant, dict):
        return None
    mode = str(quant.get("mode", "affine"))
    if mode in _MICROSCALED:
        return (*_MICROSCALED[mode], mode)
    return int(quant.get("bits", 4)), int(quant.get("group_size", 64)), mode


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
    quant_mode: str = "affine"  # mlx quantization mode of the weights (affine, mxfp4, nvfp4, mxfp8)

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


def text_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
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
    mode: str = "affine",
) -> ModelCosts:
    """Costs of `config` at mlx `bits`/`group_size` in quantization `mode` (a microscaled mode fixes
    both); `top_k` overrides experts per token. Routers mlx-lm keeps at 8 bits stay 8-bit affine."""
    model_type, cfg = text_config(config)
    weights = family_weights(model_type, cfg)
    per_weight = bytes_per_weight(bits, group_size, mode)
    if mode in _MICROSCALED:
        bits, group_size = _MICROSCALED[mode]
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
    hidden = config_int(cfg, "hidden_size", model_type)
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
        quant_mode=mode,
    )
