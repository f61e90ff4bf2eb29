"""The differential stress harness in the suite: seeded random schedules drive the real engine and every token is
compared with stock mlx-lm (bench/stress_schedules.py; the long run is `python -m bench.stress_lossless`).

The schedules below (seeds 0..N_SCHEDULES-1, replayable one by one with `--seed S --schedules 1`) interleave
governor shrinks and grows applied now or at the engine's next resize point, prefetches that arrive early, late
or never, slow reads and read errors the loader retries, and a device that runs queued graphs as it does, late or
at once; budgets 100%, 50%, 25% and per-layer splits (whole layers take their ids as slots); plain and speculative
decoding, greedy and seeded sampling; all nine families. Plain decoding's log-probabilities are compared exactly.
"""

from __future__ import annotations

import pytest

from runtime.checkpoints.tiny import FAMILIES
from tests.bench_scripts import load_bench_script

N_SCHEDULES = 32

harness = load_bench_script("stress_schedules")


@pytest.fixture(scope="module")
def refs(stress_dirs):
    """Stock references over the suite's tiny checkpoints and the dense drafter, shared by the module's tests."""
    return harness.References(stress_dirs)


def test_the_schedules_cover_every_family_budget_mode_and_sampling():
    schedules = [harness.make_schedule(s) for s in range(N_SCHEDULES)]
    assert {s.family for s in schedules} == set(FAMILIES)
    assert {s.budget for s in schedules} == set(harness.BUDGETS)
    assert {(s.mode, s.sampling) for s in schedules} == {(m, x) for m in harness.MODES for x in harness.SAMPLINGS}
    assert {s.device for s in schedules} == {"async", "lazy", "eager"}
    kinds = {kind for s in schedules for _, kind, _ in s.events}
    assert kinds == {"resize", "grow", "prefetch"}
    assert {a[1] for s in schedules for _, kind, a in s.events if kind == "prefetch"} == {"early", "late", "never"}
    faults = ";".join(s.faults for s in schedules)
    assert all(k in faults for k in ("slow:", "eio:", "eintr:", "short:"))


def test_every_token_equals_stock_under_random_schedules(refs):
    outs = [harness.run_schedule(harness.make_schedule(s), refs) for s in range(N_SCHEDULES)]
    failed = [f"{o.schedule.label()}: tokens {o.tokens} vs {o.expected}, {o.logit_mismatches} logits differ "
              f"{o.error}" for o in outs if o.failed]
    assert not failed, "\n".join(failed)
    assert sum(o.compared for o in outs) == N_SCHEDULES * harness.make_schedule(0).n_tokens
    assert sum(o.shrinks for o in outs) > 0 and sum(o.repairs for o in outs) > 0  # the schedules did interleave
