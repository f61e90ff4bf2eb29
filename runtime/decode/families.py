"""Model families whose routed experts specmoe can page.

Each supported `model_type` is a stock mlx-lm architecture whose MoE blocks keep
their experts in a SwitchGLU named `switch_mlp`. Adding a family means checking
that contract and listing it here.
"""

from __future__ import annotations

from pathlib import Path

SUPPORTED_MODEL_TYPES = {
    "qwen3_moe": "Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)",
    "mixtral": "Mixtral (8x7B, 8x22B)",
    "qwen3_next": "Qwen3-Next hybrid (GatedDeltaNet + attention, 80B-A3B)",
    "qwen3_5_moe": "Qwen3.5/3.6 MoE hybrid (35B-A3B, 397B-A17B)",
}


def text_config(config: dict) -> dict:
    """The language model's config (multimodal configs nest it under text_config)."""
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def check_supported(config: dict, where: Path | str) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: unsupported model_type {model_type!r}; specmoe pages experts of "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    return model_type


def top_k(config: dict) -> int:
    cfg = text_config(config)
    k = cfg.get("num_experts_per_tok")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"config.json: num_experts_per_tok is {k!r}; expected a positive integer")
    return k
