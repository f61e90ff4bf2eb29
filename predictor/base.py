"""The forecast interface shared by every predictor.

Invariants: a LayerForecast lists distinct expert ids, most likely first, with
non-increasing scores; forecast() is a pure function of its inputs and the
routing the predictor has observed so far (observe() is the only mutator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np


@dataclass
class DraftTaps:
    """Drafter hidden states of the tokens fed to it this round (the verify window)."""

    residual: list[dict[int, mx.array]] = field(default_factory=list)  # per token: drafter layer -> (D_d,) post-attention residual
    attention: list[dict[int, mx.array]] = field(default_factory=list)  # per token: drafter layer -> (D_d,) attention output
    # Tokens a forecast may read now (None: all). A pipelined drafter has the next step queued, whose states a
    # forecast must not wait for (runtime/decode/drafter.py).
    ready: int | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.residual)

    @property
    def n_ready(self) -> int:
        return len(self.residual) if self.ready is None else min(self.ready, len(self.residual))


@dataclass(frozen=True)
class LayerForecast:
    layer: int  # target decoder-layer index
    experts: np.ndarray  # expert ids, most likely first, distinct
    scores: np.ndarray  # score per expert (e.g. summed gate probability), non-increasing


@dataclass(frozen=True)
class ExpertForecast:
    layers: dict[int, LayerForecast]  # target layer -> forecast (absent: no forecast for that layer)

    def experts(self, layer: int) -> np.ndarray:
        f = self.layers.get(layer)
        return f.experts if f is not None else np.zeros(0, np.int64)

    @staticmethod
    def empty() -> "ExpertForecast":
        return ExpertForecast({})


def ranked(layer: int, scores: dict[int, float], limit: int | None) -> LayerForecast:
    """Turn expert -> score into a LayerForecast of the best `limit` experts."""
    items = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return LayerForecast(layer, np.array([e for e, _ in items], np.int64), np.array([s for _, s in items], np.float64))


class Predictor(Protocol):
    name: str

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        """Forecast the experts the next verify pass needs in each of `layers`."""

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        """Learn from a verify pass: target layer -> expert ids (tokens, k) it routed to."""
