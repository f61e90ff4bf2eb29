"""The oracle: replays the routing recorded in an earlier identical run.

An upper bound for benchmarks (what a perfect predictor would prefetch), never a
default. Rounds are replayed in order; a run that diverges from the recording
simply gets the recorded experts of the same round index.
"""

from __future__ import annotations

import numpy as np

from predictor.base import DraftTaps, ExpertForecast, ranked


class OraclePredictor:
    name = "oracle"

    def __init__(self, recording: list[dict[int, np.ndarray]]):
        self.recording = recording  # per verify round: target layer -> expert ids (tokens, k)
        self._round = 0

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        if self._round >= len(self.recording):
            return ExpertForecast.empty()
        rec = self.recording[self._round]
        out = {}
        for l in layers:
            if l in rec:
                ids, counts = np.unique(rec[l], return_counts=True)
                out[l] = ranked(l, dict(zip(ids.tolist(), counts.tolist())), None)
        return ExpertForecast(out)

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        self._round += 1


class RoutingRecorder:
    """Collects the verify-pass routing of a run, for an OraclePredictor to replay."""

    name = "recorder"

    def __init__(self):
        self.rounds: list[dict[int, np.ndarray]] = []

    def forecast(self, taps: DraftTaps, layers: list[int]) -> ExpertForecast:
        return ExpertForecast.empty()

    def observe(self, routing: dict[int, np.ndarray]) -> None:
        self.rounds.append({l: ids.copy() for l, ids in routing.items()})
