"""Is `specmoe generate` with the tuned settings as fast as every setting the tuner measured?

Physics: the tuner picked its setting from measurements taken earlier; machines
drift, so we re-measure in one run every setting recorded in tuning.json plus
the setting `generate` resolves by default (flags absent -> tuning.json), on the
same prompts, interleaved, and report each as a ratio to the tuned one. The
claim holds when no measured setting beats the tuned one by more than the noise.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--io-mode", default="buffered", choices=["buffered", "direct"])
    ap.add_argument("--noise", type=float, default=0.05,
                    help="least relative noise allowed before a setting counts as faster; the run's own spread "
                         "(max-min over trials of the tuned setting, relative to its median) is used when larger")
    args = ap.parse_args()
    pair = embedded_pair() if args.model is None or args.draft is None else None
    model, draft = args.model or pair.target, args.draft or pair.default_drafter
    k, pred, cut, pol, note = resolve_settings(model, draft, args.budget, None, None, None, None)
    if note is None or not note.startswith("using tuned"):
        raise SystemExit(f"no tuning for this pair and budget ({note}); run specmoe tune first")
    tuned = Setting(cut if cut is not None else -1, pred, k, pol)
    data = json.loads((Path(model) / "tuning.json").read_text())
    swept = {Setting(m["cutoff"], m["predictor"], m["num_draft"], m["policy"])
             for e in data["entries"] for m in e["measured"]}
    settings = [tuned] + sorted(swept - {tuned}, key=lambda s: s.simplicity())
    runner = SettingRunner(Workload(model, draft, args.budget, read_prompts(args.prompts), args.max_tokens, args.io_mode))
    samples = {s: [] for s in settings}
    for _ in range(args.trials):
        for s in settings:
            samples[s].append(runner.measure(s)[0].tokens_per_s)
    base = statistics.median(samples[tuned])
    spread = (max(samples[tuned]) - min(samples[tuned])) / base
    noise = max(args.noise, spread)
    print(f"{note}\nbudget {args.budget}; median decode tok/s of {args.trials} interleaved trials")
    print(f"{'setting':<42}{'tok/s':>8}{'vs tuned':>10}{'spread':>9}")
    rows = []
    for s in settings:
        tps = statistics.median(samples[s])
        label = ("TUNED " if s == tuned else "") + f"L={s.cutoff} {s.predictor} K={s.num_draft} {s.policy}"
        sp = (max(samples[s]) - min(samples[s])) / tps
        rows.append({"setting": label, "tokens_per_s": tps, "ratio_vs_tuned": tps / base, "spread": sp,
                     "trials": samples[s]})
        print(f"{label:<42}{tps:>8.2f}{tps / base:>10.3f}{sp:>9.1%}")
    worst = max(r["ratio_vs_tuned"] for r in rows)
    holds = worst <= 1 + noise
    print(f"best other setting / tuned = {worst:.3f}: tuned is {'no slower than every setting' if holds else 'SLOWER than some setting'} "
          f"within noise {noise:.1%} (the tuned setting's own spread over {args.trials} trials, at least {args.noise:.0%})")
    print(json.dumps({"bench": "tuned", "budget": args.budget, "rows": rows, "holds": holds, "noise": noise}))


if __name__ == "__main__":
    main()
