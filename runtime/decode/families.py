"""Model families whose routed experts specmoe can page.

Each supported `model_type` is a stock mlx-lm architecture that meets FAMILY_CONTRACT
(checked on the loaded model by runtime/decode/moe_blocks.py and the storage layout)
and passes tests/test_family_contract.py. Adding a family means meeting that contract,
adding a tiny fixture (runtime/checkpoints/tiny.py family_config) and listing it here.
"""

from __future__ import annotations

from pathlib import Path

SUPPORTED_MODEL_TYPES = {
    "qwen3_moe": "Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)",
    "mixtral": "Mixtral (8x7B, 8x22B)",
    "qwen3_next": "Qwen3-Next hybrid (GatedDeltaNet + attention, 80B-A3B)",
    "qwen3_5_moe": "Qwen3.5/3.6 MoE hybrid (35B-A3B, 397B-A17B)",
    "olmoe": "OLMoE (1B-7B)",
    "deepseek_v2": "DeepSeek-V2 / V2-Lite (shared experts resident, dense first layers)",
    "deepseek_v3": "DeepSeek-V3 / R1 / Kimi-K2 style (shared experts, grouped top-k)",
    "glm4_moe": "GLM-4.5 / 4.6 / 4.5-Air (shared experts, grouped top-k)",
    "gpt_oss": "gpt-oss (20b, 120b; MXFP4 experts with biases, clamped SwiGLU)",
}

FAMILY_CONTRACT = (
    "a family needs a stock mlx-lm model class whose MoE blocks keep their routed experts in a "
    "SwitchGLU-like module (gate_proj/up_proj/down_proj as SwitchLinear or QuantizedSwitchLinear, "
    "stacked [E, ...], any activation, optional bias, any quantization mode without a global scale), "
    "a router named `gate` or `router` beside it, a post_attention_layernorm in the decoder layer, "
    "and num_experts_per_tok in config.json"
)


def text_config(config: dict) -> dict:
    """The language model's config (multimodal configs nest it under text_config)."""
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def check_supported(config: dict, where: Path | str) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: unsupported model_type {model_type!r}; specmoe pages experts of "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}; {FAMILY_CONTRACT}"
        )
    return model_type


def top_k(config: dict) -> int:
    cfg = text_config(config)
    k = cfg.get("num_experts_per_tok")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"config.json: num_experts_per_tok is {k!r}; expected a positive integer")
    return k
