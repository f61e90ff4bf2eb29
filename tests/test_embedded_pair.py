"""The embedded trained pair: realistic routing, and spmoe forecasting beats the baselines on it."""

from __future__ import annotations

from importlib.resources import files

import numpy as np
import pytest

from runtime.checkpoints.embedded import embedded_pair
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.observe.profile import analyse, trace_of
from runtime.tune import run_workload


def _texts(n_chars: int = 6000) -> list[str]:
    text = (files("runtime") / "data" / "calibration.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    out, total = [], 0
    for p in paras:
        if p not in out:
            out.append(p)
            total += len(p)
        if total > n_chars:
            break
    return out


@pytest.fixture(scope="module")
def pair():
    return embedded_pair()


def test_routing_is_realistic(pair):
    """Teacher-forced on unseen English text: overlap above the independence baseline, decaying with
    distance, the shuffle control agreeing with the analytic independence value; uneven popularity."""
    om = OffloadedModel.load(pair.target, OffloadConfig(budget="100%", trace=True))
    try:
        run_workload(om, _texts(), max_tokens=0)
        report = analyse(trace_of(om), 4)
    finally:
        om.close()
    s = report["summary"]
    assert s["tokens"] > 500
    assert s["overlap"][1] > s["overlap_independent"] + 0.03, s
    assert s["overlap"][1] > s["overlap"][4], s
    assert abs(s["overlap_shuffled"][1] - s["overlap_independent"]) < 0.03, s
    assert s["unique"][4] < s["unique_independent"][4] < s["unique_uniform"][4]
    ratios = [r["popularity_max_over_uniform"] for r in report["layers"].values()]
    assert np.mean(ratios) > 2.0  # some experts far more popular than uniform


def _forecast_quality(pair, drafter, predictor: str, **kw) -> tuple[float, float]:
    """(recall, experts forecast per layer per round) over three held-out prompts of 24 tokens at 50%."""
    from runtime.decode.pairing import load_drafter
    from runtime.decode.speculative_run import run_speculative

    hits = actual = forecast = rounds = 0
    for prompt in _texts(1500)[:3]:
        om = OffloadedModel.load(pair.target, OffloadConfig(budget="50%"))
        try:
            dmodel, dconfig = load_drafter(drafter, om)
            ids = list(om.tokenizer.encode(prompt))[:24]
            _, st, _ = run_speculative(om, drafter, ids, max_tokens=24, num_draft=3, predictor=predictor,
                                       cutoff=None, draft_model=dmodel, draft_config=dconfig, **kw)
        finally:
            om.close()
        hits += sum(s.hits for s in st.per_layer.values())
        actual += sum(s.actual for s in st.per_layer.values())
        forecast += sum(s.forecast for s in st.per_layer.values())
        rounds += st.n_rounds * len(st.per_layer)
    return hits / actual, forecast / max(1, rounds)


def test_spmoe_forecasts_better_than_previous_and_popularity(pair):
    # Same cap on forecast size (2k experts per layer per round) for all three.
    recall = {p: _forecast_quality(pair, pair.default_drafter, p, forecast_limit=8)
              for p in ("previous", "popularity", "spmoe")}
    assert recall["spmoe"][0] > recall["previous"][0], recall
    assert recall["spmoe"][0] > recall["popularity"][0], recall
