"""runtime/tune/sign_test.py: the chance of a sign-test verdict among several settings when nothing differs."""

import random

import pytest

from runtime.tune.sign_test import chance_of_a_verdict, trials_needed


def test_one_setting_is_the_plain_sign_test():
    assert chance_of_a_verdict(1, 3) == pytest.approx(1 / 8)
    assert chance_of_a_verdict(1, 8) == pytest.approx(1 / 256)


def test_more_settings_make_a_lucky_winner_likelier():
    # The tuned bench's case: ten settings, three trials -> a "winner" most of the time by luck alone.
    assert chance_of_a_verdict(10, 3) == pytest.approx(1 - (7 / 8) ** 10)
    assert chance_of_a_verdict(10, 3) > 0.7 > chance_of_a_verdict(1, 3)
    assert chance_of_a_verdict(10, 8) < 0.05


def test_the_chance_matches_coin_flips():
    rng = random.Random(0)
    n, trials, runs = 10, 3, 20000
    hits = sum(any(all(rng.random() < 0.5 for _ in range(trials)) for _ in range(n)) for _ in range(runs))
    assert hits / runs == pytest.approx(chance_of_a_verdict(n, trials), abs=0.015)


def test_trials_needed_is_the_fewest_below_alpha():
    for n in (1, 2, 5, 10, 30):
        t = trials_needed(n)
        assert chance_of_a_verdict(n, t) <= 0.05 < (chance_of_a_verdict(n, t - 1) if t > 1 else 1.0)
    assert trials_needed(1) == 5 and trials_needed(10) == 8


@pytest.mark.parametrize("args", [(0, 3), (3, 0)])
def test_bad_counts_are_refused(args):
    with pytest.raises(ValueError, match="expected both >= 1"):
        chance_of_a_verdict(*args)
    with pytest.raises(ValueError, match="expected a chance"):
        trials_needed(3, alpha=1.5)
