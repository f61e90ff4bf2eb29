"""Building a predictor by name, with a clear error for unknown names."""

from __future__ import annotations

from predictor.baselines import NonePredictor, PopularityPredictor, PreviousPredictor
from predictor.oracle import OraclePredictor
from predictor.spmoe import SpmoePredictor

PREDICTORS = ("none", "previous", "popularity", "spmoe", "oracle")


def make_predictor(name: str, *, top_k: int, routers=None, layer_map=None, projections=None, recording=None,
                   limit: int | None = None):
    """`limit` caps experts per layer (popularity needs one; default 2 * top_k)."""
    if name == "none":
        return NonePredictor()
    if name == "previous":
        return PreviousPredictor(limit)
    if name == "popularity":
        return PopularityPredictor(limit or 2 * top_k)
    if name == "spmoe":
        if routers is None or layer_map is None:
            raise ValueError("--predictor spmoe needs a drafter (--draft DIR)")
        return SpmoePredictor(routers, layer_map, top_k, projections, limit)
    if name == "oracle":
        if recording is None:
            raise ValueError("--predictor oracle needs a routing recording from an earlier identical run")
        return OraclePredictor(recording)
    raise ValueError(f"--predictor {name!r}; expected one of {', '.join(PREDICTORS)}")
