"""predictor: forecasts of which routed experts a verify pass will need.

Forecasters turn what is known before verification (the drafter's per-layer
hidden states, earlier routing) into per-layer expert lists. They never touch
the expert cache or the disk; the runtime decides what to prefetch.
"""

from predictor.base import DraftTaps, ExpertForecast, LayerForecast, Predictor
from predictor.registry import PREDICTORS, make_predictor

__all__ = ["DraftTaps", "ExpertForecast", "LayerForecast", "PREDICTORS", "Predictor", "make_predictor"]
