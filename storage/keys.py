"""ExpertKey: the name of one routed expert of one MoE layer.

Invariant: layer is the decoder-layer index in the model (not the index among
MoE layers), expert is in [0, n_experts). Never pass bare tuples around.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ExpertKey:
    layer: int  # decoder-layer index as in the tensor names ("...layers.{layer}...")
    expert: int  # expert index within that layer's stacked tensors

    def __str__(self) -> str:
        return f"L{self.layer}/E{self.expert}"
