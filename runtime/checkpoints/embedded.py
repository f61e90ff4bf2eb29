"""The embedded trained pair shipped as package data (see runtime/data/tiny/card.json).

Invariant: paths point inside the installed package; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedPair:
    target: Path  # 4-bit qwen3_moe target checkpoint
    drafter: Path  # dense qwen3 drafter of the same width and depth
    drafter_shallow: Path | None  # a shallower drafter, if shipped
    card: dict  # training record: corpus, seed, losses, acceptance, routing statistics
    drafter_routed: Path | None = None  # half-depth drafter trained to forecast the target's routing, if shipped

    @property
    def default_drafter(self) -> Path:
        """The drafter demos and benches use: the routing-trained one when shipped."""
        return self.drafter_routed or self.drafter


def embedded_pair() -> EmbeddedPair:
    root = Path(str(files("runtime") / "data" / "tiny"))
    if not (root / "target" / "config.json").exists():
        raise ValueError(f"the embedded model is missing from {root}; reinstall specmoe")
    shallow = root / "drafter_shallow"
    card = json.loads((root / "card.json").read_text()) if (root / "card.json").exists() else {}
    routed = root / "drafter_routed"
    return EmbeddedPair(root / "target", root / "drafter", shallow if shallow.exists() else None, card,
                        routed if routed.exists() else None)
