"""Sign tests over interleaved trials, with the chance of a verdict when nothing differs.

A bench that compares N settings with a reference over T interleaved trials calls a setting faster (or
slower) when its per-trial ratio lies on one side of 1 in every trial: a sign test. With no real
difference a setting lands on one side in all T trials with chance 0.5 ** T, and at least one of N
settings does so with chance 1 - (1 - 0.5 ** T) ** N. Ten settings over three trials give one such
"winner" 74% of the time, so a bench (and the tuner's final say) reports that chance and counts a
verdict only below `alpha`.

Invariant: the chance treats trials as independent fair coin flips (no difference, no ties); it is the
chance for one side (faster, or slower), not for either.
"""

from __future__ import annotations

import math

ALPHA = 0.05  # the chance of a verdict by luck alone below which a bench counts it


def chance_of_a_verdict(n_compared: int, trials: int) -> float:
    """Chance that at least one of `n_compared` settings with no real difference lands on the same side of the
    reference in every one of `trials` trials (one side)."""
    if n_compared < 1 or trials < 1:
        raise ValueError(f"n_compared={n_compared}, trials={trials}; expected both >= 1")
    return 1.0 - (1.0 - 0.5 ** trials) ** n_compared


def trials_needed(n_compared: int, alpha: float = ALPHA) -> int:
    """The fewest trials for which chance_of_a_verdict(n_compared, trials) <= alpha."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}; expected a chance in (0, 1)")
    per_setting = 1.0 - (1.0 - alpha) ** (1.0 / max(1, n_compared))
    trials = max(1, math.ceil(math.log2(1.0 / per_setting)))
    while chance_of_a_verdict(n_compared, trials) > alpha:  # float rounding at the boundary
        trials += 1
    return trials
