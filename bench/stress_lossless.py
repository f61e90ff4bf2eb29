"""Lossless under every interleaving: seeded random schedules drive the real engine, every token vs stock mlx-lm.

Each schedule (bench/stress_schedules.py) loads a tiny checkpoint of one family as an OffloadedModel at a budget
(100%, 50%, 25%, or a per-layer split that leaves some layers whole), decodes plain or speculatively, greedy or
with seeded sampling, while governor shrinks and grows, prefetches (early, late, never), slow and failing reads
(retried) and a device that runs queued graphs late or at once interleave with its forwards; staged builds,
repairs and evictions follow. Every token is compared with stock mlx-lm on the resident model (plain decoding:
the log-probabilities too, exactly); a speculative seeded run with the same decoder at 100% and no events.

    python -m bench.stress_lossless --seed S --schedules N [--families a,b] [--tokens T] [--mutations]

Prints per family, budget and mode: schedules run, tokens compared, mismatched tokens and logits, runs that
raised; then each failing schedule (replay it with --seed S --schedules 1). --mutations then plants one defect at
a time (pytest's MonkeyPatch, undone after; no package code changes) and reports how many schedules, from --seed
on, it took until one failed: a hold that holds nothing, a shrink that does not bump the table version (the cached
ids-are-slots answer goes stale), a lookup whose absent flag is dropped (no repair), and a device-table entry one
slot off. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from bench.stress_schedules import (BUDGETS, MODES, SAMPLINGS, References, build_checkpoints,  # noqa: E402
                                    make_schedule, run_schedule)
from runtime.cache.cached_switch import CachedSwitchGLU  # noqa: E402
from runtime.cache.resident_tables import ResidentTables  # noqa: E402
from runtime.cache.slot_table import SlotTable  # noqa: E402
from runtime.checkpoints.tiny import FAMILIES  # noqa: E402


# -- planted defects -------------------------------------------------------------------------
def hold_noop(mp: pytest.MonkeyPatch) -> None:
    """hold() and release() do nothing: a pending graph's slots may be evicted, trimmed or overwritten."""
    mp.setattr(ResidentTables, "hold", lambda self, layers=None: None)
    mp.setattr(ResidentTables, "release", lambda self, layers=None: None)


def no_version_bump(mp: pytest.MonkeyPatch) -> None:
    """A shrink (its usable range and the trim of the experts beyond it) leaves the table version as it was: the
    cached ids-are-slots answer goes stale."""
    trim, set_usable = SlotTable.trim, SlotTable.set_usable

    def unversioned(real):
        def call(self, *args):
            version = self.version
            try:
                return real(self, *args)
            finally:
                self.version = version
        return call

    mp.setattr(SlotTable, "trim", unversioned(trim))
    mp.setattr(SlotTable, "set_usable", unversioned(set_usable))


def skipped_flag(mp: pytest.MonkeyPatch) -> None:
    """A device lookup's codes lose their absent flag (clamped to a slot): the pass never repairs that layer."""
    real = CachedSwitchGLU.lookup

    def lookup(self, x, indices, device=None):
        out, codes = real(self, x, indices, device)
        return out, mx.minimum(codes, self._last_slot)

    mp.setattr(CachedSwitchGLU, "lookup", lookup)


def off_by_one_slot(mp: pytest.MonkeyPatch) -> None:
    """A commit writes the expert's device-table entry one slot past its own (the last slot stays itself)."""
    real = SlotTable.commit

    def commit(self, key) -> None:
        real(self, key)
        ls = self.layers[key.layer]
        slot = int(ls.expert_to_slot[key.expert])
        ls.resident[key.expert] = min(slot + 1, ls.n_slots - 1)

    mp.setattr(SlotTable, "commit", commit)


MUTATIONS = {"hold as a no-op": hold_noop, "no version bump": no_version_bump, "skipped repair flag": skipped_flag,
             "off-by-one slot": off_by_one_slot}


# -- runs ------------------------------------------------------------------------------------
def run_many(refs: References, seed: int, n: int, families=FAMILIES, n_tokens: int = 12, stop_at_first=False):
    """Outcomes of schedules seed, seed+1, ... (n of them); with stop_at_first, up to the first that fails."""
    outs = []
    for s in range(seed, seed + n):
        out = run_schedule(make_schedule(s, families, n_tokens=n_tokens), refs)
        outs.append(out)
        if stop_at_first and out.failed:
            break
    return outs


def schedules_to_catch(refs: References, plant, seed: int, max_n: int, families=FAMILIES, n_tokens: int = 12):
    """How many schedules from `seed` on run until one fails with `plant` applied (None: none did in max_n), and
    the failing outcome."""
    mp = pytest.MonkeyPatch()
    try:
        plant(mp)
        outs = run_many(refs, seed, max_n, families, n_tokens, stop_at_first=True)
    finally:
        mp.undo()
    return (len(outs), outs[-1]) if outs and outs[-1].failed else (None, None)


def summarize(outs: list) -> dict:
    """Per (family, budget, mode) and in total: schedules, tokens compared, mismatches, logit mismatches, errors."""
    rows = defaultdict(lambda: {"schedules": 0, "tokens": 0, "mismatches": 0, "logit_mismatches": 0, "errors": 0})
    for o in outs:
        s = o.schedule
        for key in ((s.family, s.budget, s.mode), ("all", "", "")):
            r = rows[key]
            r["schedules"] += 1
            r["tokens"] += o.compared
            r["mismatches"] += o.mismatches
            r["logit_mismatches"] += o.logit_mismatches
            r["errors"] += bool(o.error)
    return rows


def print_table(rows: dict) -> None:
    print(f"{'family':<12} {'budget':<6} {'mode':<5} {'schedules':>9} {'tokens':>7} {'mismatch':>8} {'logits':>6} "
          f"{'errors':>6}")
    for (fam, budget, mode), r in sorted(rows.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        print(f"{fam:<12} {budget:<6} {mode:<5} {r['schedules']:>9} {r['tokens']:>7} {r['mismatches']:>8} "
              f"{r['logit_mismatches']:>6} {r['errors']:>6}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="first schedule's seed (schedule i uses seed + i)")
    ap.add_argument("--schedules", type=int, default=50, help="schedules to run")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all 9)")
    ap.add_argument("--tokens", type=int, default=12, help="tokens each schedule decodes")
    ap.add_argument("--mutations", action="store_true",
                    help="then plant each defect in turn and count the schedules, from --seed on, until one fails")
    ap.add_argument("--max-schedules", type=int, default=60, help="--mutations: give up on a defect after this many")
    ap.add_argument("--mutation-starts", type=int, default=1,
                    help="--mutations: count from this many start seeds (--seed, --seed + 1000, ...)")
    args = ap.parse_args(argv)
    families = tuple(args.families.split(","))
    bad = [f for f in families if f not in FAMILIES]
    problem = (f"--families {','.join(bad)}: expected some of {','.join(FAMILIES)}" if bad else
               f"--schedules {args.schedules}: expected >= 1" if args.schedules < 1 else
               f"--tokens {args.tokens}: expected >= 2" if args.tokens < 2 else
               f"--max-schedules {args.max_schedules}: expected >= 1" if args.max_schedules < 1 else
               f"--mutation-starts {args.mutation_starts}: expected >= 1" if args.mutation_starts < 1 else "")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {os.getloadavg()[0]:.2f}, seed {args.seed}, "
          f"budgets {','.join(BUDGETS)}, modes {','.join(MODES)}, sampling {','.join(SAMPLINGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        refs = References(build_checkpoints(Path(tmp), families))
        outs = run_many(refs, args.seed, args.schedules, families, args.tokens)
        rows = summarize(outs)
        print_table(rows)
        for o in outs:
            if o.failed:
                print(f"FAILED {o.schedule.label()}: tokens {o.tokens} vs {o.expected}, "
                      f"{o.logit_mismatches} logits differ {o.error}")
        result = {"schedules": len(outs), **rows[("all", "", "")],
                  "failed_seeds": [o.schedule.seed for o in outs if o.failed]}
        if args.mutations:
            starts = [args.seed + 1000 * i for i in range(args.mutation_starts)]
            result["mutations"] = {}
            print(f"\n{'mutation':<22} {'schedules to catch from seed ' + ', '.join(map(str, starts)):>40}  "
                  f"first failing schedule")
            for name, plant in MUTATIONS.items():
                found = [schedules_to_catch(refs, plant, s, args.max_schedules, families, args.tokens) for s in starts]
                counts = [n for n, _ in found]
                first = next((out for _, out in found if out is not None), None)
                what = (first.error or f"{first.mismatches} tokens, {first.logit_mismatches} logits differ") \
                    if first else ""
                shown = ", ".join(str(n) if n else f"> {args.max_schedules}" for n in counts)
                print(f"{name:<22} {shown:>40}  {first.schedule.label() + ': ' + what if first else ''}")
                result["mutations"][name] = counts
    result.update(seed=args.seed, families=list(families), seconds=round(time.perf_counter() - t0, 1),
                  load_average=round(os.getloadavg()[0], 2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
