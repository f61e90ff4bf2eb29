"""The stress harness can fail: each planted defect (pytest's monkeypatch, undone after the test; no package code
changes) makes a schedule fail within a stated number of schedules from seed 0 (bench/stress_lossless.py's
MUTATIONS; `python -m bench.stress_lossless --mutations` reports the counts, bench/results/stress_lossless.txt).

- a hold that holds nothing: a shrink trims slots a pending forward reads (ids as slots, or gathered before);
- a shrink that does not bump the table version: the cached ids-are-slots answer stays true after a trim;
- a lookup whose absent flag is dropped: no repair, the clamped slot's expert runs;
- a device-table entry one slot off.
The same schedules pass without the defect (tests/test_lossless_stress.py runs them and more).
"""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench_script

# Schedules (from seed 0) within which each defect must make one fail: about twice what was measured here from
# seed 0 (8, 27, 1, 1). From seeds 1000, 2000, 3000, 4000 (bench/results/stress_lossless.txt): at most 19, 87, 4, 4.
WITHIN = {"hold as a no-op": 20, "no version bump": 60, "skipped repair flag": 3, "off-by-one slot": 3}

harness = load_bench_script("stress_schedules")
mutations = load_bench_script("stress_lossless").MUTATIONS


@pytest.fixture(scope="module")
def refs(stress_dirs):
    return harness.References(stress_dirs)


@pytest.mark.parametrize("name", list(WITHIN))
def test_a_planted_defect_fails_a_schedule(refs, monkeypatch, name):
    mutations[name](monkeypatch)
    for seed in range(WITHIN[name]):
        out = harness.run_schedule(harness.make_schedule(seed), refs)
        if out.failed:
            break
    assert out.failed, f"{name}: no schedule of {WITHIN[name]} failed"
    assert out.error or out.mismatches or out.logit_mismatches
