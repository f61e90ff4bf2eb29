"""Synthetic checkpoints with real expert sizes, for I/O benchmarks.

Writes an mlx-lm-layout checkpoint directory holding only stacked, 4-bit-shaped
expert tensors (random bytes) of one MoE layer or more, so the store and loader
see real byte layouts and expert sizes (e.g. Qwen3.5-35B-A3B's 1.77 MB) without
building a model. Not loadable as a model: for storage benchmarks only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_expert_checkpoint(out: Path, *, n_layers: int = 1, n_experts: int = 128, hidden: int = 2048,
                            expert_hidden: int = 512, group_size: int = 64, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": n_experts, "num_experts_per_tok": 8, "hidden_size": hidden,
        "num_hidden_layers": n_layers, "quantization": {"group_size": group_size, "bits": 4, "mode": "affine"},
    }))
    tensors = {"model.embed_tokens.weight": rng.standard_normal((16, hidden), dtype=np.float32)}
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.mlp.switch_mlp"
        for proj, (rows, cols) in {"gate_proj": (expert_hidden, hidden), "up_proj": (expert_hidden, hidden),
                                   "down_proj": (hidden, expert_hidden)}.items():
            tensors[f"{prefix}.{proj}.weight"] = rng.integers(0, 2**32, (n_experts, rows, cols // 8), dtype=np.uint32)
            for part in ("scales", "biases"):
                tensors[f"{prefix}.{proj}.{part}"] = rng.standard_normal((n_experts, rows, cols // group_size)).astype(np.float16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    return out
