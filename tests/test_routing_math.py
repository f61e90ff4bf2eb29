"""routing_math against the seeds' analytic numbers (MoESD N(t) and T_thres, Cohere's decomposition)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.observe.routing_math import (
    expected_tokens_per_round,
    fit_power_law_exponent,
    power_law_hit_rate,
    saturation_threshold,
    speculative_speedup,
    tokens_per_expert,
    uniform_unique_experts,
    verify_cost_ratio,
)


def test_uniform_unique_experts_matches_seed_29_1():
    # Seed 000: 4 tokens, k=8 of N=128 under uniform routing touch 29.1 unique experts.
    assert uniform_unique_experts(128, 8, 4) == pytest.approx(29.1, abs=0.05)


def test_uniform_unique_experts_edges():
    assert uniform_unique_experts(128, 8, 0) == 0.0
    assert uniform_unique_experts(128, 8, 1) == pytest.approx(8.0)
    assert uniform_unique_experts(8, 8, 5) == pytest.approx(8.0)


@pytest.mark.parametrize("n_experts, top_k, expected", [(64, 8, 23), (128, 8, 47), (256, 8, 95)])
def test_saturation_threshold_matches_moesd(n_experts, top_k, expected):
    # Seed 002: tau=0.95 gives 23, 47, 95 tokens for rho = 1/8, 1/16, 1/32.
    assert saturation_threshold(top_k, n_experts) == expected


def test_saturation_threshold_full_activation_is_one_token():
    assert saturation_threshold(8, 8) == 1


@settings(max_examples=200, deadline=None)
@given(n_experts=st.integers(2, 1024), data=st.data())
def test_unique_experts_bounds_and_threshold_property(n_experts, data):
    top_k = data.draw(st.integers(1, n_experts - 1))
    tau = data.draw(st.floats(0.5, 0.99))
    n_tokens = data.draw(st.integers(1, 64))
    unique = uniform_unique_experts(n_experts, top_k, n_tokens)
    assert top_k - 1e-9 <= unique <= min(n_experts, top_k * n_tokens) + 1e-9
    assert uniform_unique_experts(n_experts, top_k, n_tokens + 1) >= unique
    threshold = saturation_threshold(top_k, n_experts, tau)
    assert uniform_unique_experts(n_experts, top_k, threshold) >= tau * n_experts * (1 - 1e-9)
    if threshold > 1:
        assert uniform_unique_experts(n_experts, top_k, threshold - 1) < tau * n_experts


def test_tokens_per_expert_is_one_for_one_token_and_grows():
    assert tokens_per_expert(128, 8, 1) == pytest.approx(1.0)
    assert tokens_per_expert(128, 8, 4) == pytest.approx(32 / 29.11, rel=1e-3)
    assert tokens_per_expert(128, 8, 64) > tokens_per_expert(128, 8, 4)


def test_expected_tokens_per_round():
    # alpha = 0.75 at K = 3 gives Cohere's acceptance length 2.73.
    assert expected_tokens_per_round(0.75, 3) == pytest.approx(2.73, abs=0.01)
    assert expected_tokens_per_round(1.0, 3) == 4.0
    assert expected_tokens_per_round(0.0, 3) == 1.0


def test_cohere_decomposition_numbers():
    # Seed 000: f = 0.30 with 20.36 measured unique experts (k = 8) predicts T(4)/T(1) = 1.46,
    # and acceptance length 2.73 gives 1.87x predicted and 2.18x with the measured 1.25.
    ratio = verify_cost_ratio(0.30, 20.36 / 8)
    assert ratio == pytest.approx(1.46, abs=0.01)
    assert speculative_speedup(2.73, ratio) == pytest.approx(1.87, abs=0.01)
    assert speculative_speedup(2.73, 1.25) == pytest.approx(2.18, abs=0.01)
    assert speculative_speedup(2.73, 1.25, draft_ratio=0.143) < 2.0


def test_power_law_prior_and_fit_recover_exponent():
    points = [(c, c**0.3) for c in (0.05, 0.2, 0.5, 0.8)]
    assert fit_power_law_exponent(points) == pytest.approx(0.3)
    assert power_law_hit_rate(0.0, 0.3) == 0.0
    assert power_law_hit_rate(1.0, 0.3) == 1.0
    assert power_law_hit_rate(0.5, 0.3) == pytest.approx(0.5**0.3)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: uniform_unique_experts(0, 1, 1), "n_experts"),
        (lambda: uniform_unique_experts(8, 9, 1), "top_k"),
        (lambda: uniform_unique_experts(8, 2, -1), "n_tokens"),
        (lambda: saturation_threshold(8, 128, tau=1.0), "tau"),
        (lambda: expected_tokens_per_round(1.5, 3), "acceptance_rate"),
        (lambda: verify_cost_ratio(0.3, 0.5), "unique_expert_ratio"),
        (lambda: speculative_speedup(0.5, 1.0), "tokens_per_round"),
        (lambda: fit_power_law_exponent([(1.0, 0.5)]), "inside"),
        (lambda: fit_power_law_exponent([]), "at least one"),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_threshold_is_exact_ceiling():
    exact = math.log(0.05) / math.log(1 - 1 / 8)
    assert saturation_threshold(1, 8) == math.ceil(exact)
