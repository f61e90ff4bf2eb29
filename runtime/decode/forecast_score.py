"""ForecastScore: how well a forecast of experts matched the experts a layer then used.

Shared by the speculative decoder (spmoe and the baselines, per MoE layer) and the router
lookahead (per distance). Invariant: hits <= min(forecast, actual), so recall and precision lie in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ForecastScore:
    hits: int = 0  # forecast experts the layer used
    forecast: int = 0  # experts forecast
    actual: int = 0  # unique experts the layer used (in calls that had a forecast)

    @property
    def recall(self) -> float:
        return self.hits / self.actual if self.actual else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.forecast if self.forecast else 0.0
