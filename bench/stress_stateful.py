"""Lossless under every interleaving, explored and shrunk by Hypothesis: the stateful stress run as a command.

The seeded harness (bench/stress_lossless.py) draws whole schedules from a seed and reports a failing one as drawn.
Here Hypothesis drives the engine step by step (bench/stress_machine.py: start an engine; decode n tokens, each
compared with stock mlx-lm, plain decoding's log-probabilities exactly; governor shrinks and grows, resizes from
an I/O thread, prefetches early, late or never, slow reads, retried read errors, the device running queued work
late or at once) and shrinks a failure to a minimal sequence.

    python -m bench.stress_stateful --examples N [--steps S] [--tokens T] [--families a,b] [--mutations]

Prints the clean run (examples, steps, tokens and log-probabilities compared, mismatches), then, with --mutations,
per planted defect (bench/stress_lossless.py's MUTATIONS, undone after) whether Hypothesis found it, at which
example, and the length of the shrunk sequence (start included) with the sequence; one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stress_machine import N_TOKENS, Tally, explore, find_mutation, shown  # noqa: E402
from bench.stress_schedules import BUDGETS, MODES, SAMPLINGS, References, build_checkpoints  # noqa: E402
from runtime.checkpoints.tiny import FAMILIES  # noqa: E402


# -- the command ---------------------------------------------------------------------------
def main(argv=None) -> int:
    from bench.stress_lossless import MUTATIONS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=100, help="examples (machines, one engine each) of the clean run")
    ap.add_argument("--steps", type=int, default=20, help="steps per example (start included)")
    ap.add_argument("--tokens", type=int, default=N_TOKENS, help="tokens a machine may decode")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all 9)")
    ap.add_argument("--mutations", action="store_true",
                    help="then plant each defect in turn and report whether Hypothesis finds it and the shrunk length")
    ap.add_argument("--mutation-examples", type=int, default=60,
                    help="--mutations: examples Hypothesis may run before giving up on a defect")
    ap.add_argument("--mutation-modes", default="plain",
                    help="--mutations: decoding modes to explore (plain: a defect's effect does not hang on when the "
                         "loader's threads finish a forecast's reads, so the shrunk sequence replays)")
    ap.add_argument("--shrink-seconds", type=float, default=120.0,
                    help="--mutations: stop shrinking a defect's failure after this long (Hypothesis's own: 300)")
    args = ap.parse_args(argv)
    families = tuple(args.families.split(","))
    mutation_modes = tuple(args.mutation_modes.split(","))
    bad = [f for f in families if f not in FAMILIES]
    problem = (f"--families {','.join(bad)}: expected some of {','.join(FAMILIES)}" if bad else
               f"--mutation-modes {args.mutation_modes}: expected some of {','.join(MODES)}"
               if set(mutation_modes) - set(MODES) else
               f"--examples {args.examples}: expected >= 1" if args.examples < 1 else
               f"--steps {args.steps}: expected >= 2" if args.steps < 2 else
               f"--tokens {args.tokens}: expected >= 1" if args.tokens < 1 else
               f"--mutation-examples {args.mutation_examples}: expected >= 1" if args.mutation_examples < 1 else
               f"--shrink-seconds {args.shrink_seconds}: expected > 0" if args.shrink_seconds <= 0 else "")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    lines = []
    options = dict(families=families, n_tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        refs = References(build_checkpoints(Path(tmp), families))
        tally = Tally()
        clean = explore(refs, tally, args.examples, args.steps, **options)
        result = {"examples": tally.examples, "steps": tally.steps, "tokens": tally.tokens, "logits": tally.logits,
                  "mismatches": tally.mismatches, "errors": tally.errors, "failed": clean.failed}
        lines.append(f"{'examples':>8} {'steps':>6} {'tokens':>7} {'logits':>6} {'mismatch':>8} {'errors':>6}  "
                     f"clean run ({clean.seconds:.0f} s)")
        lines.append(f"{tally.examples:>8} {tally.steps:>6} {tally.tokens:>7} {tally.logits:>6} {tally.mismatches:>8} "
                     f"{tally.errors:>6}")
        lines.append("rules run: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.rules.items())))
        modes = Counter((f, m, s) for (f, _, m, s), n in tally.configs.items() for _ in range(n))
        lines.append("machines by family, mode, sampling: " + ", ".join(
            f"{f} {m} {s} {n}" for (f, m, s), n in sorted(modes.items())))
        if clean.failed:
            lines.append(f"FAILED: {clean.error}\n  shrunk to {len(clean.trace)} steps: {shown(clean.trace)}")
        if args.mutations:
            result["mutations"] = {}
            lines.append(f"\nplanted defects, modes {','.join(mutation_modes)}, up to {args.mutation_examples} examples "
                         f"each, shrinking up to {args.shrink_seconds:.0f} s")
            lines.append(f"{'mutation':<22} {'found':>5} {'after examples':>14} {'examples run':>12} "
                         f"{'shrunk steps':>12} {'seconds':>7}  shrunk sequence")
            for name, plant in MUTATIONS.items():
                found, t = find_mutation(refs, plant, args.mutation_examples, args.steps,
                                         shrink_seconds=args.shrink_seconds, **options, modes=mutation_modes)
                lines.append(f"{name:<22} {'yes' if found.failed else 'no':>5} {t.first_failure or '-':>14} "
                             f"{t.examples:>12} {len(found.trace) if found.failed else '-':>12} "
                             f"{found.seconds:>7.0f}  {shown(found.trace) if found.failed else ''}")
                if found.failed:
                    lines.append(f"{'':<22} {found.error}")
                result["mutations"][name] = {"found": found.failed, "first_failing_example": t.first_failure,
                                             "examples_run": t.examples,
                                             "shrunk_steps": len(found.trace) if found.failed else None,
                                             "seconds": round(found.seconds, 1)}
    cmd = "python -m bench.stress_stateful " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# {cmd.strip()}, {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average before "
          f"{load_before:.2f} after {os.getloadavg()[0]:.2f}, {time.perf_counter() - t0:.0f} s")
    print(f"# families {','.join(families)}; budgets {','.join(BUDGETS)}; modes {','.join(MODES)}; sampling "
          f"{','.join(SAMPLINGS)}; {args.steps} steps an example, up to {args.tokens} tokens; Hypothesis derandomized")
    print("\n".join(lines))
    result.update(families=list(families), seconds=round(time.perf_counter() - t0, 1),
                  load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
