"""Routing analysis on hand-made traces with known answers, and the published formulas."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.observe.analysis import (
    independence_overlap, independence_unique, layer_report, overlap, popularity, shuffled, unique_in_windows,
    uniform_overlap, verify_cost_ratios,
)
from runtime.observe.routing_math import saturation_threshold, uniform_unique_experts


def test_identical_consecutive_routing_overlaps_fully():
    s = np.array([[1, 2]] * 6)
    assert overlap([s], 1, 8) == 1.0 and overlap([s], 3, 8) == 1.0
    assert unique_in_windows([s], 4, 8) == 2


def test_alternating_routing():
    s = np.array([[0, 1], [2, 3]] * 5)
    assert overlap([s], 1, 4) == 0.0
    assert overlap([s], 2, 4) == 1.0
    assert unique_in_windows([s], 1, 4) == 2 and unique_in_windows([s], 2, 4) == 4


def test_windows_and_distances_do_not_cross_sequences():
    a, b = np.array([[0, 1], [0, 1]]), np.array([[2, 3], [2, 3]])
    assert overlap([a, b], 1, 4) == 1.0  # the a->b boundary pair is not counted
    assert unique_in_windows([a, b], 2, 4) == 2
    assert np.isnan(overlap([a, b], 2, 4))


def test_popularity_and_independence_formulas():
    s = np.array([[0, 1], [0, 2], [0, 3], [0, 1]])
    p = popularity([s], 4)
    assert p.tolist() == [1.0, 0.5, 0.25, 0.25]
    assert independence_overlap(p, 2) == pytest.approx((1 + 0.25 + 0.0625 * 2) / 2)
    assert independence_unique(p, 2) == pytest.approx(1 + 0.75 + 2 * (1 - 0.75**2))
    assert uniform_overlap(8, 128) == 1 / 16


def test_shuffle_control_matches_analytic_independence():
    rng = np.random.default_rng(1)
    n, k = 32, 4
    weights = rng.dirichlet(np.ones(n) * 0.5)
    seqs = [np.stack([rng.choice(n, k, replace=False, p=weights) for _ in range(400)]) for _ in range(5)]
    p = popularity(seqs, n)
    shuf = shuffled(seqs, np.random.default_rng(2))
    assert overlap(shuf, 1, n) == pytest.approx(independence_overlap(p, k), abs=0.02)
    assert unique_in_windows(shuf, 4, n) == pytest.approx(independence_unique(p, 4), abs=0.3)
    # Independent draws also measure at the analytic value without shuffling.
    assert overlap(seqs, 1, n) == pytest.approx(independence_overlap(p, k), abs=0.02)


def test_temporally_correlated_trace_beats_both_baselines():
    rng = np.random.default_rng(3)
    n, rows = 64, [rng.choice(64, 4, replace=False)]
    for _ in range(999):  # keep half of the previous token's experts
        keep = rows[-1][:2]
        rest = rng.choice(np.setdiff1d(np.arange(n), keep), 2, replace=False)
        rows.append(rng.permutation(np.concatenate([keep, rest])))
    r = layer_report([np.stack(rows)], n)
    assert r["overlap"][1] > r["overlap_independent"] + 0.3
    assert r["overlap"][1] > r["overlap"][4]  # decays with distance
    assert abs(r["overlap_shuffled"][1] - r["overlap_independent"]) < 0.02
    assert r["unique"][4] < r["unique_independent"][4] < r["unique_uniform"][4]


def test_published_numbers():
    assert round(uniform_unique_experts(128, 8, 4), 1) == 29.1
    assert [saturation_threshold(k, n, 0.95) for k, n in ((8, 64), (8, 128), (8, 256))] == [23, 47, 95]


def test_verify_cost_ratios():
    assert verify_cost_ratios({1: 2.0, 4: 3.0, 8: 5.0}) == {1: 1.0, 4: 1.5, 8: 2.5}
    with pytest.raises(ValueError, match="t=1"):
        verify_cost_ratios({4: 3.0})
