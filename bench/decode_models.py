"""The two models the decode benches measure, by name: "embedded" (the shipped trained target, 8 MoE layers x 64
experts) and "synthetic" (a random-weight qwen3_moe, 12 layers x 64 experts, top-4, written into a scratch
directory). Invariant: the same name gives the same weights in every bench (seed 0), so their rows compare."""

from __future__ import annotations

from pathlib import Path

from runtime.checkpoints import make_tiny
from runtime.checkpoints.embedded import embedded_pair

NAMES = ("synthetic", "embedded")


def decode_model(name: str, scratch: Path) -> Path:
    """The checkpoint directory of `name`; the synthetic one is written under `scratch`."""
    if name == "embedded":
        return embedded_pair().target
    if name == "synthetic":
        return make_tiny(scratch / "synthetic", "qwen3_moe", seed=0, layers=12, n_experts=64, top_k=4,
                         hidden=384, expert_hidden=256)
    raise ValueError(f"{name!r}; expected one of {', '.join(NAMES)}")
