"""Warm start below a full budget: does filling the cache with the most used experts before decoding pay?

Physics: at a partial budget a cold cache misses on the first tokens' experts; a warm start reads each MoE
layer's most used experts (as many as its slots hold) before decoding, queued before the prefill so the
reads overlap it. It can only win where the first tokens' misses cost more than the reads it adds, and only
while the warm experts are the ones the prompt routes to. Measured: time from the call to the Nth token
(prefill + first token + N-1 decode steps) through `runtime.stream_generate`, on a fresh engine per run (a
cold cache), direct reads (O_DIRECT: a miss is a disk read). Variants: "cold" (the default), "cold'" (the
A/A control), "warm, other text" (counts from other prompts: what a trace or tuning.json gives) and "warm,
same prompt" (counts from the measured prompt itself: the best a warm start can do). Each trial runs every
variant once per prompt in a fresh order; a ratio is cold's time over the variant's in the same trial and
prompt (>1: the variant is faster). The warm reads are queued with `cache.warm` right before the call, as
the engine did. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import stream_generate  # noqa: E402
from runtime.api import Engine  # noqa: E402
from runtime.checkpoints.embedded import embedded_pair  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402
from storage import ExpertKey  # noqa: E402

PROMPTS = [line.strip() for line in (Path(__file__).parent / "prompts.txt").read_text().splitlines() if line.strip()]
VARIANTS = ("cold", "cold'", "warm, other text", "warm, same prompt")


def routing_counts(target: Path, prompts: list[str], n: int) -> dict[int, np.ndarray]:
    """How often each expert was routed (prefill and decode) over `prompts`, n tokens each, full budget."""
    om = OffloadedModel.load(target, OffloadConfig(budget="100%", trace=True))
    try:
        engine = Engine(om)
        for p in prompts:
            for _ in stream_generate(engine, p, n):
                pass
        om.telemetry.flush()
        counts = {l: np.zeros(om.store.layout(l).n_experts, np.int64) for l in om.moe_layers}
        for sequence in om.telemetry.sequences:
            for block in sequence:  # (tokens, layers, k)
                for i, l in enumerate(om.moe_layers):
                    counts[l] += np.bincount(block[:, i, :].reshape(-1), minlength=counts[l].size)[: counts[l].size]
        return counts
    finally:
        om.close()


def timed_run(target: Path, prompt: str, n: int, budget: str, counts) -> dict:
    om = OffloadedModel.load(target, OffloadConfig(budget=budget, io_mode="direct"))
    try:
        engine = Engine(om)
        t0 = time.perf_counter()
        if counts is not None:  # each layer's most used experts, as many as its slots hold
            om.cache.warm([ExpertKey(l, int(e)) for l in om.moe_layers
                           for e in np.argsort(-counts[l], kind="stable")[: om.cache.usable_slots(l)] if counts[l][e] > 0])
        ttft, k = None, 0
        for r in stream_generate(engine, prompt, n):
            k += 1
            ttft = ttft or time.perf_counter() - t0
        return {"ttft": ttft, "total": time.perf_counter() - t0, "tokens": k}
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--trials", type=int, default=6)
    args = ap.parse_args()
    load_before = os.getloadavg()
    target = embedded_pair().target
    same = {p: routing_counts(target, [p], args.tokens) for p in PROMPTS}
    other = {p: routing_counts(target, [q for q in PROMPTS if q != p], 32) for p in PROMPTS}
    timed_run(target, PROMPTS[0], 4, args.budget, None)  # warmup (imports, first graphs)
    runs = {v: [] for v in VARIANTS}
    order = random.Random(0)
    for _ in range(args.trials):
        for p in PROMPTS:
            trial = {}
            for v in order.sample(VARIANTS, len(VARIANTS)):
                counts = same[p] if v == "warm, same prompt" else other[p] if v == "warm, other text" else None
                trial[v] = timed_run(target, p, args.tokens, args.budget, counts)
            for v in VARIANTS:
                runs[v].append({**trial[v], "ratio": trial["cold"]["total"] / trial[v]["total"]})
    print(f"embedded target {target}, budget {args.budget}, direct reads, greedy, {args.tokens} tokens x "
          f"{len(PROMPTS)} prompts, {args.trials} trials (variants in a fresh order per prompt, a fresh engine per "
          f"run); ms: median [min-max] from the call to token {args.tokens}; vs cold: cold's time over the "
          f"variant's in the same trial and prompt, median [min-max] (>1 faster), runs faster than cold")
    print(f"{'variant':<20}{'TTFT ms':>22}{'to token N, ms':>24}{'vs cold':>22}{'faster':>8}")
    out = {}
    for v in VARIANTS:
        t = [r["ttft"] * 1e3 for r in runs[v]]
        tot = [r["total"] * 1e3 for r in runs[v]]
        ratio = [r["ratio"] for r in runs[v]]
        won = sum(x > 1 for x in ratio)
        out[v] = {"ttft_ms": t, "total_ms": tot, "ratio_vs_cold": ratio}
        print(f"{v:<20}{f'{statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]':>22}"
              f"{f'{statistics.median(tot):.1f} [{min(tot):.1f}-{max(tot):.1f}]':>24}"
              f"{f'{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]':>22}{f'{won}/{len(ratio)}':>8}")
    print(json.dumps({"bench": "warm", "budget": args.budget, "tokens": args.tokens, "trials": args.trials,
                      "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": out}))


if __name__ == "__main__":
    main()
