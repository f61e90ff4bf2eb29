"""Forecasters that use no drafter signal: none, previous, popularity.

- none: forecasts nothing (prefetch off).
- previous: the experts the last verify pass routed to, per layer.
- popularity: per-layer expert frequencies with exponential decay.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from predictor.base import DraftTaps, ExpertForecast, ranked


class NonePredictor:
    name = "none"

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        return ExpertForecast.empty()

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        pass


class PreviousPredictor:
    """Experts of the last verified window; ranked by how many of its tokens used them."""

    name = "previous"

    def __init__(self, limit: int | None = None):
        self.limit = limit  # experts per layer at most (None: all of the window's)
        self._last: dict[int, Counter] = {}

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        return ExpertForecast({l: ranked(l, dict(self._last[l]), self.limit) for l in layers if l in self._last})

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        self._last = {l: Counter(ids.reshape(-1).tolist()) for l, ids in routing.items()}


class PopularityPredictor:
    """The experts used most, with older uses decayed by `decay` per observed pass."""

    name = "popularity"

    def __init__(self, limit: int, decay: float = 0.9):
        if not 0 < decay <= 1:
            raise ValueError(f"popularity decay={decay}; expected 0 < decay <= 1")
        self.limit = limit
        self.decay = decay
        self._counts: dict[int, np.ndarray] = {}

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        out = {}
        for l in layers:
            c = self._counts.get(l)
            if c is not None and c.any():
                out[l] = ranked(l, {int(e): float(c[e]) for e in np.flatnonzero(c)}, self.limit)
        return ExpertForecast(out)

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        for l, ids in routing.items():
            flat = ids.reshape(-1)
            c = self._counts.get(l)
            size = max(int(flat.max()) + 1, 0 if c is None else c.size)
            if c is None or c.size < size:
                c = np.pad(c if c is not None else np.zeros(0), (0, size - (0 if c is None else c.size)))
            c *= self.decay
            np.add.at(c, flat, 1.0)
            self._counts[l] = c
