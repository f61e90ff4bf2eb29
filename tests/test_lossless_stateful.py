"""The stateful stress machine in the suite: Hypothesis drives one engine step by step and shrinks a failure to a
minimal sequence (bench/stress_machine.py; the long run is `python -m bench.stress_stateful`,
bench/results/stress_stateful.txt).

Each example starts one engine (family, budget or per-layer split, plain or speculative, greedy or seeded sampling,
one-sync setting, device), then interleaves decode(n) with governor shrinks and grows (now or at the engine's next
resize point), resizes requested from an I/O thread at a given read, prefetches that arrive early, late or never,
slow reads and read errors the loader retries, and the device switching between running queued work as it does,
late or at once. Every token equals stock mlx-lm's (plain decoding: its log-probabilities exactly).

It can fail: planted defects (bench/stress_lossless.py's MUTATIONS, monkeypatched for the run and undone) are
found and shrunk. Here: a device-table entry one slot off and a lookup whose absent flag is dropped (no repair),
each found within a few examples and shrunk to two steps. A hold that holds nothing and a shrink that does not bump
the table version need a race (a shrink while a forward is pending, then a decode): the seeded schedules catch those
(tests/test_stress_mutations.py); how often this machine does is in bench/results/stress_stateful.txt. The long
tier (`-m long`) runs the clean machine over all nine families.
"""

from __future__ import annotations

import pytest

from runtime.checkpoints.tiny import FAMILIES
from tests.bench_scripts import load_bench_script

CI_FAMILIES = ("qwen3_moe", "mixtral")  # plain KV + switch_mlp; a block_sparse_moe family
EXAMPLES, STEPS = 30, 16  # the clean run in the default tier: ~30 engines, 16 steps each

machine = load_bench_script("stress_machine")
mutations = load_bench_script("stress_lossless").MUTATIONS


@pytest.fixture(scope="module")
def refs(stress_dirs):
    """Stock references over the suite's tiny checkpoints and the dense drafter, shared by the module's tests."""
    return machine.References(stress_dirs)


def _check_clean(refs, families, examples, steps) -> None:
    tally = machine.Tally()
    found = machine.explore(refs, tally, examples, steps, families=families)
    assert not found.failed, f"{found.error}\nshrunk to: {machine.shown(found.trace)}"
    assert tally.examples >= examples and tally.mismatches == 0 and tally.errors == 0
    assert tally.tokens >= 2 * examples and tally.logits > 0  # every example decodes; plain ones compare logits
    assert set(tally.rules) == {"start", "decode", "shrink", "grow", "prefetch", "governor_at_read", "read_error",
                                "slow_reads", "device_runs"}
    assert {f for f, _, _, _ in tally.configs} == set(families)
    assert {m for _, _, m, _ in tally.configs} == set(machine.MODES)


def test_every_token_equals_stock_under_explored_interleavings(refs):
    _check_clean(refs, CI_FAMILIES, EXAMPLES, STEPS)


@pytest.mark.long
def test_every_token_equals_stock_under_explored_interleavings_every_family(refs):
    _check_clean(refs, FAMILIES, 200, 16)  # bench/results/stress_stateful.txt's clean run


def _check_found(refs, name, within, shrunk_at_most, families=CI_FAMILIES, steps=STEPS) -> None:
    """Hypothesis finds the planted defect within `within` examples and shrinks it to at most `shrunk_at_most`
    steps; the shrunk sequence fails with the defect and passes without it. Plain decoding only: there a defect's
    effect does not hang on when the loader's threads finish a forecast's reads, so the shrunk sequence replays."""
    options = dict(families=families, modes=("plain",))
    found, tally = machine.find_mutation(refs, mutations[name], within, steps, **options)
    assert found.failed, f"{name}: no failure in {tally.examples} examples"
    assert tally.first_failure is not None and tally.first_failure <= within
    print(f"{name}: found at example {tally.first_failure}, shrunk to {len(found.trace)} steps "
          f"({tally.examples} examples in all): {machine.shown(found.trace)}")
    last, args = found.trace[-1]
    assert found.trace[0][0] == "start" and (last == "decode" or args.get("then")), "the last step decodes"
    assert len(found.trace) <= shrunk_at_most, machine.shown(found.trace)
    assert machine.replay(refs, found.trace, **options) == "", "the shrunk sequence fails without the defect"
    mp = pytest.MonkeyPatch()
    try:
        mutations[name](mp)
        assert machine.replay(refs, found.trace, **options), "the shrunk sequence passes with the defect"
    finally:
        mp.undo()


# Found from the derandomized start (measured on qwen3_moe and mixtral, plain decoding: the off-by-one slot at example
# 1, shrunk to start + decode(n=1); the dropped flag at example 3, shrunk to start + shrink(n=4, now=False, then=1)).
# The bounds leave room for a changed engine to need more; the search depends on max_examples, so `within` is also
# the budget that was measured.
@pytest.mark.parametrize("name, within, shrunk_at_most", [("off-by-one slot", 10, 2), ("skipped repair flag", 60, 2)])
def test_hypothesis_finds_and_shrinks_a_planted_defect(refs, name, within, shrunk_at_most):
    _check_found(refs, name, within, shrunk_at_most)
