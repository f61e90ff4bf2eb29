"""Decode speed of the offloaded model against stock mlx-lm, same checkpoint, one run.

Physics: a decode step reads every resident weight once plus top_k experts per MoE
layer. Fully resident (stock) pays no I/O; at a budget below 100% a step pays for
its misses (bytes from the page cache or SSD) plus our per-layer host sync that
reads the router's choice -- one sync per step instead when every expert the step
routes to is resident (runtime/decode/one_sync.py). With files hot, a miss costs a memory copy, so at 50%
the offloaded model should stay close to stock (target >= 0.95x).

Variants, all greedy on the same prompts, files hot (one warmup run first):
stock mlx-lm fully resident, and specmoe at 100%, 50% and 25% budgets.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402
from runtime.decode import OneSyncModel  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402

PROMPTS = [
    "The history of the river begins in the mountains, where",
    "def load_experts(path):\n    \"\"\"Read every expert",
    "Once upon a time a model was larger than the machine that ran it, and",
]


def decode_tps(model, tokenizer, n_tokens: int, om=None) -> tuple[float, float, float]:
    """Median decode tok/s over PROMPTS; misses and MB read per decoded token."""
    speeds, misses, nbytes, decoded = [], 0, 0, 0
    for prompt in PROMPTS:
        ids = mx.array(tokenizer.encode(prompt))
        gen = generate_step(ids, model, max_tokens=n_tokens)
        next(gen)  # prefill + first token: not decode
        c0 = om.counters() if om else None
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        speeds.append(n / (time.perf_counter() - t0))
        if om:
            c1 = om.counters()
            misses += c1["misses"] - c0["misses"]
            nbytes += c1["bytes_read"] - c0["bytes_read"]
        decoded += n
    return statistics.median(speeds), misses / decoded, nbytes / decoded / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build a synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--one-sync", default="auto", choices=["auto", "off"],
                    help="one-sync decode steps (runtime/decode/one_sync.py), as `specmoe generate` runs them")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        variants = [("stock", None)] + [(f"specmoe {b}", b) for b in args.budgets.split(",")]
        loaded = {}
        for name, budget in variants:
            if budget is None:
                model, tok = load(str(path))
                loaded[name] = (model, tok, None)
            else:
                om = OffloadedModel.load(path, OffloadConfig(budget=budget))
                # What generate_tokens runs: decode steps tried with one host sync while they succeed.
                model = om.model if args.one_sync == "off" else OneSyncModel(om)
                loaded[name] = (model, om.tokenizer, om)
        for model, tok, om in loaded.values():  # warmup: files hot, kernels built
            decode_tps(model, tok, 8, om)
        samples = {name: [] for name, _ in variants}
        io = {}
        for _ in range(args.trials):  # interleave variants so drift hits all alike
            for name, _ in variants:
                model, tok, om = loaded[name]
                tps, mpt, mbpt = decode_tps(model, tok, args.tokens, om)
                samples[name].append(tps)
                io[name] = (mpt, mbpt)
        expert_mb = None
        for _, _, om in loaded.values():
            if om:
                expert_mb = om.store.expert_bytes_total / 1e6
                om.close()

    stock = statistics.median(samples["stock"])
    print(f"model: {path} ({expert_mb:.1f} MB of experts); greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, "
          f"median of {args.trials} interleaved trials, files hot; vs stock: median [min-max] of per-trial ratios")
    print(f"{'variant':<16}{'tok/s':>9}{'vs stock [min-max]':>22}{'misses/tok':>12}{'MB read/tok':>13}")
    results = {}
    for name, _ in variants:
        tps = statistics.median(samples[name])
        mpt, mbpt = io.get(name, (0.0, 0.0))
        ratios = [a / b for a, b in zip(samples[name], samples["stock"])]
        results[name] = {"tokens_per_s": tps, "ratio_vs_stock": tps / stock, "ratio_median": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios), "misses_per_token": mpt,
                         "mb_read_per_token": mbpt}
        spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(f"{name:<16}{tps:>9.1f}{spread:>22}{mpt:>12.2f}{mbpt:>13.3f}")
    print(json.dumps({"bench": "decode", "model": str(args.model or "synthetic qwen3_moe 8x64 experts"),
                      "one_sync": args.one_sync, "tokens": args.tokens, "trials": args.trials, "results": results}))


if __name__ == "__main__":
    main()
