"""The embedded trained pair: realistic routing, and spmoe forecasting beats the baselines on it."""

from __future__ import annotations

from importlib.resources import files

import numpy as np
import pytest

from runtime.embedded import embedded_pair
from runtime.offloaded_model import OffloadConfig, OffloadedModel
from runtime.profile_run import analyse, run_workload, trace_of


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


def test_spmoe_forecasts_better_than_previous_and_popularity(pair):
    from runtime.draft_setup import load_drafter
    from runtime.spec_run import run_speculative

    recall = {}
    for predictor in ("previous", "popularity", "spmoe"):
        hits = actual = forecast = 0
        for prompt in _texts(1500)[:3]:
            om = OffloadedModel.load(pair.target, OffloadConfig(budget="50%"))
            try:
                dmodel, dconfig = load_drafter(pair.drafter, om)
                ids = list(om.tokenizer.encode(prompt))[:24]
                _, st, _ = run_speculative(om, pair.drafter, ids, max_tokens=24, num_draft=3, predictor=predictor,
                                           cutoff=None, draft_model=dmodel, draft_config=dconfig)
            finally:
                om.close()
            hits += sum(s.hits for s in st.per_layer.values())
            actual += sum(s.actual for s in st.per_layer.values())
            forecast += sum(s.forecast for s in st.per_layer.values())
        recall[predictor] = (hits / actual, forecast / max(1, st.n_rounds))
    # Same cap on forecast size (2k experts per layer) for all three.
    assert recall["spmoe"][0] > recall["previous"][0], recall
    assert recall["spmoe"][0] > recall["popularity"][0], recall
