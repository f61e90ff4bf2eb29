"""Prefill of a long prompt: bytes read against the unique experts it routes, and time against stock.

Physics: a prefill chunk of N tokens routes N * k (token, expert) pairs per MoE layer; with N in
the thousands nearly every expert of every layer is routed. The least a cache of any size must
read is each routed expert once per chunk (expert-major prefill, runtime/cache/expert_major.py).
Splitting the chunk into token groups that fit the cache instead re-reads experts the groups
evict from each other (issue 16 measured 37x the expert set at 25%). With files hot a read is a
memory copy, so prefill time should approach stock's: the FLOPs are the same, and what is added
is the copies, one host sync per expert batch, and the batching overhead.

Method: bench_decode.py's synthetic checkpoint (qwen3_moe, 8 MoE layers x 64 experts, top-4,
hidden 256) unless --model; a prompt of --tokens tokens from the calibration text; prefill as
mlx-lm's generate_step runs it (chunks of 2048 tokens, then the first token), timed to the first
token. Stock mlx-lm fully resident against specmoe at each budget, a fresh OffloadedModel (empty
cache) per trial, files hot (one warmup run of each variant first), variants interleaved per
trial. The first token's log-probabilities must equal stock's bit for bit.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from runtime.checkpoints import make_tiny  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = (files("runtime") / "data" / "calibration.txt").read_text()
    ids = tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def first_token(model, ids: list[int]) -> tuple[float, int, np.ndarray]:
    t0 = time.perf_counter()
    token, logprobs = next(generate_step(mx.array(ids), model, max_tokens=1))
    return time.perf_counter() - t0, int(token), np.array(logprobs)


def run_offloaded(path: Path, budget: str, ids: list[int]) -> dict:
    om = OffloadedModel.load(path, OffloadConfig(budget=budget, governor=None))
    try:
        routed: dict[int, set] = {}
        om.set_observer(lambda layer, e: routed.setdefault(layer, set()).update(np.unique(e).tolist()))
        c0 = om.counters()
        seconds, token, logprobs = first_token(om.model, ids)
        c1 = om.counters()
        unique = sum(len(s) for s in routed.values())
        unique_bytes = sum(len(s) * om.store.layout(l).expert_bytes for l, s in routed.items())
        return {"seconds": seconds, "token": token, "logprobs": logprobs, "reads": c1["misses"] - c0["misses"],
                "bytes_read": c1["bytes_read"] - c0["bytes_read"], "unique_experts": unique,
                "unique_bytes": unique_bytes, "slots": min(om.plan.slots.values()),
                "expert_bytes_total": om.store.expert_bytes_total}
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: bench_decode's synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budgets", default="25%,100%")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        stock, tok = load(str(path))
        ids = prompt_ids(tok, args.tokens)
        budgets = args.budgets.split(",")
        first_token(stock, ids[:64])  # warmup: kernels built
        for b in budgets:
            run_offloaded(path, b, ids[:64])  # warmup: files hot
        times = {name: [] for name in ["stock"] + budgets}
        last: dict[str, dict] = {}
        for _ in range(args.trials):  # interleaved, so drift hits all alike
            s, stock_token, stock_lp = first_token(stock, ids)
            times["stock"].append(s)
            for b in budgets:
                r = run_offloaded(path, b, ids)
                if r["token"] != stock_token or not np.array_equal(r["logprobs"], stock_lp):
                    raise SystemExit(f"specmoe {b}: the first token's log-probabilities differ from stock")
                times[b].append(r["seconds"])
                last[b] = r

    base = statistics.median(times["stock"])
    print(f"model: {args.model or 'synthetic qwen3_moe 8x64 experts, hidden 256'} "
          f"({next(iter(last.values()))['expert_bytes_total'] / 1e6:.1f} MB of experts); prompt {len(ids)} tokens; "
          f"time to first token, median (min-max) of {args.trials} interleaved trials, files hot; "
          f"first-token log-probs equal stock bit for bit in every trial")
    print(f"{'variant':<14}{'slots':>6}{'seconds':>22}{'tok/s':>8}{'vs stock':>9}{'reads':>7}{'unique':>7}"
          f"{'MB read':>9}{'MB unique':>10}{'read/unique':>12}")
    results = {"stock": {"seconds": base, "spread": [min(times["stock"]), max(times["stock"])],
                         "tokens_per_s": len(ids) / base}}
    print(f"{'stock':<14}{'':>6}{base:>9.2f} ({min(times['stock']):.2f}-{max(times['stock']):.2f}){len(ids) / base:>8.0f}"
          f"{1.0:>9.2f}")
    for b in budgets:
        r, t = last[b], statistics.median(times[b])
        ratio = r["bytes_read"] / r["unique_bytes"]
        results[b] = {"seconds": t, "spread": [min(times[b]), max(times[b])], "tokens_per_s": len(ids) / t,
                      "time_vs_stock": t / base, "reads": r["reads"], "unique_experts": r["unique_experts"],
                      "bytes_read": r["bytes_read"], "unique_bytes": r["unique_bytes"], "bytes_vs_unique": ratio,
                      "slots_per_layer": r["slots"]}
        print(f"{'specmoe ' + b:<14}{r['slots']:>6}{t:>9.2f} ({min(times[b]):.2f}-{max(times[b]):.2f}){len(ids) / t:>8.0f}"
              f"{t / base:>9.2f}{r['reads']:>7}{r['unique_experts']:>7}{r['bytes_read'] / 1e6:>9.1f}"
              f"{r['unique_bytes'] / 1e6:>10.1f}{ratio:>12.3f}")
    print(json.dumps({"bench": "prefill", "prompt_tokens": len(ids), "trials": args.trials, "results": results}))


if __name__ == "__main__":
    main()
