"""What a drafter the target never accepts costs against plain decoding.

Physics: a drafter of random weights (same tokenizer, another width: bench/random_drafter.py)
proposes tokens the target almost never agrees with. Adaptive K (runtime/decode/draft_length.py)
then falls to 0 within a few rounds and re-probes with K = 1 after stretches that double up to 64
tokens; what remains against plain decoding is (a) the drafter's prefill and the first round, a probe
(one drafter step beside a plain round), (b) the later probes, each feeding the drafter the stretch's
tokens in one batched forward, and (c) whatever a K = 0 token costs
beyond a plain token -- nothing when the stretch decodes as plain decoding does
(runtime/decode/plain_stretch.py). The goal: at most 10% (ratio >= 0.90).

Cases: the embedded target (width 128) with a width-64 random drafter, and a mid-size checkpoint --
the qwen3-30b-a3b preset's real widths (hidden 2048, 128 experts top-8, vocab 151,936) cut to a few
layers (bench/fullscale_checkpoint.py), random weights -- with a Qwen3-0.6B-width random drafter
(hidden 1024). The predictor is what the default resolves to for a pair of different widths with no
projection (runtime/decode/predictor_default.py). Plain and speculative runs of one prompt run back to
back, in a fresh order each pass, each from an empty expert cache; "ratio" is the median of the
per-prompt speculative/plain tok/s ratios with their min-max. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.random_drafter import write_random_drafter  # noqa: E402
from runtime.checkpoints import embedded_pair  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel, generate_tokens, load_drafter, speculative_decoder  # noqa: E402
from runtime.decode.predictor_default import FALLBACK  # noqa: E402

PROMPTS = ["The old steward walked the length of the hall and said to the king that the winter would be long.",
           "To open a file for reading, call the built-in function and pass the path as its first argument.",
           "When the loop ends, the function returns the list of results to the caller, in the order they were computed."]


def run_once(target: Path, draft: Path | None, prompt: str, args) -> dict:
    om = OffloadedModel.load(target, OffloadConfig(budget=args.budget, io_mode=args.io_mode))
    try:
        ids = list(om.tokenizer.encode(prompt))
        if draft is None:
            _, stats = generate_tokens(om.model, ids, max_tokens=args.tokens, om=om)
            return {"tokens_per_s": stats.tokens_per_s, "path": stats.decode_path}
        dmodel, dconfig = load_drafter(draft, om)
        decoder = speculative_decoder(om, draft, ids, max_tokens=args.tokens, num_draft=args.num_draft,
                                      predictor=FALLBACK, cutoff=None, draft_model=dmodel, draft_config=dconfig)
        tokens = decoder.generate(ids, args.tokens)
        s = decoder.stats
        # per target forward, as plain's rate: plain's first token comes with its prefill, so its decode time holds
        # n - 1 forwards for n - 1 tokens; every one of the n tokens here is a decode round's
        history = getattr(decoder.draft_length, "history", None)
        return {"tokens_per_s": len(tokens) / max(1e-9, s.decode_s), "acceptance": s.acceptance,
                "plain_rounds": s.n_plain_rounds, "rounds": s.n_rounds, "k_history": history}
    finally:
        om.close()


def measure(name: str, target: Path, draft: Path, args) -> dict:
    ratios, plain, spec, histories = [], [], [], []
    for rep in range(args.repeats):
        for prompt in PROMPTS[: args.prompts]:
            order = [None, draft]
            random.Random(hash((rep, prompt))).shuffle(order)
            runs = {("spec" if d else "plain"): run_once(target, d, prompt, args) for d in order}
            plain.append(runs["plain"]["tokens_per_s"])
            spec.append(runs["spec"]["tokens_per_s"])
            ratios.append(spec[-1] / plain[-1])
            histories.append(runs["spec"])
    h = histories[0]
    return {"case": name, "target": str(target), "draft": str(draft), "plain_tok_s": statistics.median(plain),
            "spec_tok_s": statistics.median(spec), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratios": ratios, "acceptance": statistics.mean(r["acceptance"] for r in histories),
            "plain_rounds_share": sum(r["plain_rounds"] for r in histories) / max(1, sum(r["rounds"] for r in histories)),
            "k_history": h["k_history"]}


def mid_size(root: Path, layers: int) -> Path:
    from bench.fullscale_checkpoint import main as write_checkpoint

    out = root / f"qwen3-30b-a3b-{layers}l"
    if not (out / "config.json").exists():
        write_checkpoint(["--preset", "qwen3-30b-a3b", "--layers", str(layers), "--out", str(out)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="embedded,mid", help="comma-separated: embedded, mid")
    ap.add_argument("--mid", type=Path, default=None,
                    help="the mid-size checkpoint (default: written to a temporary directory, ~1.5 GB at 4 layers)")
    ap.add_argument("--mid-layers", type=int, default=4, help="layers of the mid-size checkpoint when written here")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2, help=f"prompts per pass (at most {len(PROMPTS)})")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    ap.add_argument("--io-mode", default="direct", choices=["buffered", "direct"])
    args = ap.parse_args()
    load0 = os.getloadavg()
    t0 = time.time()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for case in args.cases.split(","):
            if case == "embedded":
                target = embedded_pair().target
                draft = write_random_drafter(tmp / "d64", target, hidden=64, layers=4, seed=3)
            elif case == "mid":
                target = args.mid or mid_size(tmp, args.mid_layers)
                draft = write_random_drafter(tmp / "d1024", target, hidden=1024, layers=3, seed=3)
            else:
                raise SystemExit(f"--cases {case!r}; expected embedded or mid")
            results.append(measure(case, target, draft, args))
    load1 = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} | load average before {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} | wall {time.time() - t0:.0f} s")
    print(f"budget {args.budget}, greedy, {args.tokens} tokens x {args.prompts} prompts x {args.repeats} passes, "
          f"K={args.num_draft} adaptive, predictor {FALLBACK} (the default for a pair of different widths without a "
          f"projection), io={args.io_mode}; ratio: median [min-max] of per-prompt speculative/plain decode tok/s")
    print(f"{'case':10} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio [min-max]':>20} {'accept':>7} {'K=0 rounds':>10}  K history ([K, rounds] runs)")
    for r in results:
        print(f"{r['case']:10} {r['plain_tok_s']:11.2f} {r['spec_tok_s']:10.2f} "
              f"{r['ratio']:8.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] {r['acceptance']:7.0%} "
              f"{r['plain_rounds_share']:10.0%}  {r['k_history']}")
    print(json.dumps({"bench": "speculative_unaccepted", "budget": args.budget, "tokens": args.tokens,
                      "num_draft": args.num_draft, "load_avg": [load0, load1], "results": results}))


if __name__ == "__main__":
    main()
