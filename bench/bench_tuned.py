"""Is `specmoe generate` with the tuned settings as fast as every setting the tuner measured?

Physics: the tuner picked its setting from measurements taken earlier; machines
drift, so we re-measure in one run every setting recorded in tuning.json plus
the setting `generate` resolves by default (flags absent -> tuning.json), on the
same prompts, interleaved (a fresh order per trial), and report each as the median
[min-max] of its per-trial ratios to the tuned one. The claim holds when no measured
setting beats the tuned one in every trial (a range that lies above 1) beyond chance: with N settings
and T trials, one that does not differ lands above 1 in every trial with chance 0.5^T, and at least one
of the N does so with chance 1 - (1 - 0.5^T)^N (runtime/tune/sign_test.py). A verdict counts only when that
chance is at most 5%; else the row says "within chance". Ten settings need 8 trials.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.tune.sign_test import ALPHA, chance_of_a_verdict, trials_needed  # noqa: E402
from runtime.checkpoints import embedded_pair  # noqa: E402
from runtime.observe import read_prompts  # noqa: E402
from runtime.tune import SettingRunner, Workload  # noqa: E402
from runtime.tune import resolve_settings  # noqa: E402
from runtime.tune import Setting  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=8,
                    help="interleaved trials (default 8: with ten settings, fewer cannot name a winner beyond chance)")
    ap.add_argument("--io-mode", default="buffered", choices=["buffered", "direct"])
    ap.add_argument("--noise", type=float, default=0.0,
                    help="margin a setting must clear in every trial to count as faster (default 0: faster in every "
                         "trial, i.e. its per-trial ratio range lies above 1)")
    args = ap.parse_args()
    pair = embedded_pair() if args.model is None or args.draft is None else None
    model, draft = args.model or pair.target, args.draft or pair.default_drafter
    k, pred, cut, pol, note = resolve_settings(model, draft, args.budget, None, None, None, None)
    if note is None or not note.startswith("using tuned"):
        raise SystemExit(f"no tuning for this pair and budget ({note}); run specmoe tune first")
    tuned = Setting(cut if cut is not None else -1, pred, k, pol)
    data = json.loads((Path(model) / "tuning.json").read_text())
    swept = {Setting(m["cutoff"], m["predictor"], m["num_draft"], m["policy"]) for e in data["entries"] for m in e["measured"]}
    settings = [tuned] + sorted(swept - {tuned}, key=lambda s: s.simplicity())
    runner = SettingRunner(Workload(model, draft, args.budget, read_prompts(args.prompts), args.max_tokens, args.io_mode))
    samples = {s: [] for s in settings}
    misses = {s: [] for s in settings}
    order = random.Random(0)
    load0 = os.getloadavg()
    for _ in range(args.trials):  # interleaved: every setting once per trial, in a fresh order
        for s in order.sample(settings, len(settings)):
            m = runner.measure(s)[0]
            samples[s].append(m.tokens_per_s)
            misses[s].append(m.misses_per_token)
    load1 = os.getloadavg()
    print(f"{note}\nbudget {args.budget}; {args.trials} interleaved trials (every setting once per trial, fresh order); "
          f"tok/s: median [min-max]; vs tuned: median [min-max] of per-trial ratios; load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'setting':<48}{'tok/s [min-max]':>22}{'vs tuned [min-max]':>22}{'misses/tok':>11}  verdict")
    n_compared = max(1, len(settings) - 1)
    chance, needed = chance_of_a_verdict(n_compared, args.trials), trials_needed(n_compared)
    counts = chance <= ALPHA  # a setting on one side in every trial is a verdict only if luck alone rarely makes one
    luck = f"within chance ({chance:.0%} with {len(settings) - 1} settings x {args.trials} trials)"
    rows = []
    for s in settings:
        tps = statistics.median(samples[s])
        ratios = [a / b for a, b in zip(samples[s], samples[tuned])]
        r, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
        if s == tuned:
            verdict = "-"
        elif lo > 1 + args.noise:
            verdict = "FASTER than tuned in every trial" if counts else f"faster in every trial, {luck}"
        elif hi < 1:
            verdict = "slower in every trial" if counts else f"slower in every trial, {luck}"
        else:
            verdict = "within the noise"
        label = ("TUNED " if s == tuned else "") + f"L={s.cutoff} {s.predictor} K={s.num_draft} {s.policy}"
        rows.append({"setting": label, "tokens_per_s": tps, "tokens_per_s_min": min(samples[s]),
                     "tokens_per_s_max": max(samples[s]), "ratio_vs_tuned": r, "ratio_min": lo, "ratio_max": hi,
                     "misses_per_token": statistics.median(misses[s]), "verdict": verdict, "trials": samples[s]})
        print(f"{label:<48}{f'{tps:.1f} [{min(samples[s]):.1f}-{max(samples[s]):.1f}]':>22}"
              f"{f'{r:.3f} [{lo:.2f}-{hi:.2f}]':>22}{statistics.median(misses[s]):>11.2f}  {verdict}")
    beaten = [r["setting"] for r in rows if r["verdict"].startswith("FASTER")]
    holds = not beaten
    print(f"tuned is {'no slower than every setting outside the noise' if holds else 'SLOWER than ' + ', '.join(beaten)} "
          f"(a setting counts as faster only if it beat the tuned one in every one of {args.trials} trials, and "
          f"{len(settings) - 1} settings that do not differ would give such a verdict by chance {chance:.1%} of the time: "
          f"{'under' if counts else 'over'} {ALPHA:.0%}; {needed} trials get under it)")
    print(json.dumps({"bench": "tuned", "budget": args.budget, "trials": args.trials, "load_avg": [load0, load1],
                      "chance_of_a_verdict": chance, "verdicts_count": counts,
                      "trials_needed": needed, "rows": rows, "holds": holds}))

if __name__ == "__main__":
    main()
