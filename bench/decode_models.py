"""The two models the decode benches measure, by name: "embedded" (the shipped trained target, 8 MoE layers x 64
experts) and "synthetic" (a random-weight qwen3_moe, 12 layers x 64 experts, top-4, written into a scratch
directory). Invariant: the same name gives the same weights in every bench (seed 0), so their rows compare."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

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


def each_model(names: str, error: Callable[[str], None], measure: Callable) -> tuple[list[str], dict]:
    """measure(name, path) -> (table lines, results) for each model of the comma list `names`, the synthetic one
    written to a scratch directory removed afterwards; an unknown name goes to error() (argparse's ap.error).
    Returns every table, each followed by a blank line, and {name: results}."""
    lines, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names.split(","):
            try:
                path = decode_model(name, Path(tmp))
            except ValueError as e:
                error(f"--models: {e}")
            table, results[name] = measure(name, path)
            lines += table + [""]
    return lines, results
