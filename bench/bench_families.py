"""Per-family decode on tiny real-layout checkpoints: offloaded vs stock mlx-lm, same process.

For every family specmoe pages (runtime.checkpoints.tiny.FAMILIES), a tiny random-weight
checkpoint (mlx-lm's own classes and quantization; gpt-oss MXFP4 with biases) is decoded by
stock mlx-lm and by the offloaded model at 100% and 50% budgets, interleaved, `--trials`
times. Reported: stock tok/s, the offloaded/stock ratio (median, min-max over trials),
misses and KB read per decoded token at 50%, and whether the tokens were identical.
Tiny models on a shared CPU: the ratio shows per-token overhead (one host sync per MoE
layer plus cache bookkeeping), not what a large model on a Mac would see.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load  # noqa: E402

from bench.bench_decode import decode_tps  # noqa: E402
from runtime.checkpoints.tiny import FAMILIES, make_tiny  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402
from tests.conftest import PROMPT, greedy_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            path = make_tiny(Path(tmp) / fam, fam, seed=1, layers=3, n_experts=32, top_k=4)
            stock, tok = load(str(path))
            oms = {b: OffloadedModel.load(path, OffloadConfig(budget=b)) for b in ("100%", "50%")}
            ids = tok.encode(PROMPT)
            same = all(greedy_ids(om.model, ids) == greedy_ids(stock, ids) for om in oms.values())
            for om in oms.values():
                decode_tps(om.model, om.tokenizer, 4, om)  # warm
            samples = {"stock": [], "100%": [], "50%": []}
            per_token = None
            for _ in range(args.trials):
                samples["stock"].append(decode_tps(stock, tok, args.tokens)[0])
                for b, om in oms.items():
                    tps, per = decode_tps(om.model, om.tokenizer, args.tokens, om)
                    samples[b].append(tps)
                    if b == "50%":
                        per_token = (per["misses_per_token"], per["mb_read_per_token"] * 1e3)
            for om in oms.values():
                om.close()
            s = statistics.median(samples["stock"])
            ratio = {b: [x / y for x, y in zip(samples[b], samples["stock"])] for b in ("100%", "50%")}
            rows.append({"family": fam, "stock_tps": round(s, 1), "identical_tokens": same,
                         **{f"ratio_{b}": {"median": round(statistics.median(r), 3), "min": round(min(r), 3),
                                           "max": round(max(r), 3)} for b, r in ratio.items()},
                         "misses_per_token_50": round(per_token[0], 2), "kb_read_per_token_50": round(per_token[1], 1)})
    print(f"{'family':<13} {'stock tok/s':>11} {'100% / stock':>20} {'50% / stock':>20} {'miss/tok@50':>11} {'KB/tok@50':>9} same")
    for r in rows:
        fmt = lambda d: f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"  # noqa: E731
        print(f"{r['family']:<13} {r['stock_tps']:>11.1f} {fmt(r['ratio_100%']):>20} {fmt(r['ratio_50%']):>20} "
              f"{r['misses_per_token_50']:>11.2f} {r['kb_read_per_token_50']:>9.1f} {r['identical_tokens']}")
    print(json.dumps({"bench": "families", "tokens": args.tokens, "trials": args.trials, "rows": rows}))


if __name__ == "__main__":
    main()
