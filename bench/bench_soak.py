"""Soak: thousands of speculative tokens under a 25% expert budget, watching memory.

What a long run can go wrong with: memory that creeps up (a cache of tensors, a
per-round record kept forever, MLX's buffer cache), loads that fail once in a
hundred thousand, threads that die. The expert cache itself is fixed-size (slabs
allocated once), so after warm-up RSS should be flat; anything else grows with
the number of tokens and shows up as drift.

Setup: a tiny qwen3_moe target (4 MoE layers x 64 experts, top-4) packed with
CRC checks on, a dense qwen3 drafter of the same width and depth, spmoe (or
--predictor) prefetch for every layer, budget 25%. The run is a sequence of
sessions (a prompt from a rotating set, --session-tokens each, a fresh KV cache)
on one OffloadedModel, like a server. The first session is checked token for
token against plain greedy decoding. RSS (psutil) and MLX's active memory are
sampled after every session.

Prints a table of memory over time, the drift after warm-up against a stated
bound, cumulative misses and errors; the last line is JSON.

    python bench/bench_soak.py [--tokens 10000] [--session-tokens 500] [--no-telemetry] [--inject SPEC]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import mlx.core as mx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import load, stream_generate  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402
from storage.packer import convert  # noqa: E402

PROMPTS = [
    "Experts live on disk and wake when the router calls their names.",
    "The quick brown fox jumps over the lazy dog while the river runs past the old mill.",
    "Numbers such as 1, 2, 3, 10, 42 and 2048 appear in text, and so do words like memory and budget.",
    "Once upon a time a model was larger than the machine that ran it, and it ran anyway.",
    "A small cache keeps the busy ones close, and the loader fetches the others before they are missed.",
]
MB = 1 << 20


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000, help="Tokens to generate in total.")
    ap.add_argument("--session-tokens", type=int, default=500, help="Tokens per session (prompt + fresh KV cache).")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--predictor", default="spmoe", help="none, previous, popularity or spmoe.")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--warmup-sessions", type=int, default=2, help="Sessions before RSS drift is measured.")
    ap.add_argument("--drift-bound-mb", type=float, default=5.0, help="Allowed RSS range after warm-up.")
    ap.add_argument("--telemetry", action=argparse.BooleanOptionalAction, default=True,
                    help="Keep per-round telemetry, as `specmoe generate` does (default: on).")
    ap.add_argument("--inject", default="", help="Fault spec (storage/faults.py) to run the soak under.")
    args = ap.parse_args()
    proc = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = make_tiny(root / "target", "qwen3_moe", seed=1, layers=4, n_experts=64, top_k=4)
        packed = convert(raw, root / "packed")
        drafter_dir = make_tiny(root / "drafter", "qwen3", seed=9, layers=4)
        engine = load(packed, args.budget, drafter_dir, num_draft=args.num_draft, predictor=args.predictor,
                      cutoff=None, policy="lru", verify=True, threads=4, telemetry=args.telemetry, inject=args.inject)
        plain_engine = load(packed, args.budget, policy="lru", telemetry=False)  # the losslessness reference
        om = engine.model
        slots = sorted(set(om.plan.slots.values()))
        print(f"target: qwen3_moe tiny, {len(om.moe_layers)} MoE layers x 64 experts, top-{om.top_k}; "
              f"budget {args.budget} = {slots} slots/layer; drafter qwen3 tiny; predictor {args.predictor}, "
              f"K={args.num_draft}; telemetry {'on' if args.telemetry else 'off'}; inject {args.inject or 'none'}")
        rows, samples, error = [], [], None
        done, session, checked = 0, 0, None
        t0 = time.perf_counter()
        try:
            while done < args.tokens:
                prompt = PROMPTS[session % len(PROMPTS)]
                ids = om.tokenizer.encode(prompt)
                n = min(args.session_tokens, args.tokens - done)
                responses = list(stream_generate(engine, ids, n))
                tokens, stats = [r.token for r in responses], responses[-1].detail
                if session == 0:  # losslessness, once: the same prompt by plain greedy decoding
                    plain = [r.token for r in stream_generate(plain_engine, ids, n)]
                    checked = plain == tokens
                done += len(tokens)
                session += 1
                gc.collect()
                c = om.counters()
                rss = proc.memory_info().rss
                samples.append(rss)
                rows.append({"tokens": done, "elapsed_s": time.perf_counter() - t0, "rss_mb": rss / MB,
                             "mlx_active_mb": mx.get_active_memory() / MB, "mlx_cache_mb": mx.get_cache_memory() / MB,
                             "misses": c["misses"], "hit_rate": c["hits"] / max(1, c["hits"] + c["misses"]),
                             "prefetch_used": c["prefetch_hits"], "acceptance": stats.acceptance,
                             "retries": om.loader.stats.n_retries, "failed_loads": om.loader.stats.n_failed})
                r = rows[-1]
                print(f"  {r['tokens']:>6} tokens  {r['elapsed_s']:7.1f} s  RSS {r['rss_mb']:7.1f} MB", file=sys.stderr, flush=True)
        except Exception as e:  # a soak reports the error instead of dying without a table
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        elapsed = time.perf_counter() - t0
        alive = om.loader.threads_alive()
        engine.close()
        plain_engine.close()
    print()
    print("| tokens | elapsed s | tok/s | RSS MB | MLX active MB | MLX cache MB | misses (cum.) | hit rate | prefetch used | retries | failed loads |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    prev_t, prev_n = 0.0, 0
    for r in rows:
        tps = (r["tokens"] - prev_n) / max(1e-9, r["elapsed_s"] - prev_t)
        prev_t, prev_n = r["elapsed_s"], r["tokens"]
        print(f"| {r['tokens']} | {r['elapsed_s']:.1f} | {tps:.1f} | {r['rss_mb']:.1f} | {r['mlx_active_mb']:.1f} | "
              f"{r['mlx_cache_mb']:.1f} | {r['misses']} | {r['hit_rate']:.1%} | {r['prefetch_used']} | {r['retries']} | {r['failed_loads']} |")
    steady = samples[args.warmup_sessions:] or samples
    drift_mb = (max(steady) - min(steady)) / MB if steady else 0.0
    growth_mb = (steady[-1] - steady[0]) / MB if steady else 0.0
    slope = _slope([r["tokens"] for r in rows][-len(steady):], [x / MB for x in steady]) * 10_000
    flat = drift_mb <= args.drift_bound_mb
    print()
    print(f"RSS after {args.warmup_sessions} warm-up sessions: range {drift_mb:.1f} MB, first->last {growth_mb:+.1f} MB, "
          f"trend {slope:+.1f} MB per 10k tokens (bound {args.drift_bound_mb:g} MB: {'flat' if flat else 'NOT FLAT'}); "
          f"first session equals plain greedy: {checked}; I/O threads alive: {alive}; error: {error or 'none'}")
    print(json.dumps({"tokens": done, "elapsed_s": round(elapsed, 1), "tokens_per_s": round(done / elapsed, 1) if elapsed else 0,
                      "budget": args.budget, "predictor": args.predictor, "telemetry": args.telemetry, "inject": args.inject,
                      "rss_mb": [round(s / MB, 1) for s in samples], "rss_drift_mb": round(drift_mb, 1),
                      "rss_growth_mb": round(growth_mb, 1), "rss_mb_per_10k_tokens": round(slope, 2), "drift_bound_mb": args.drift_bound_mb, "flat": flat,
                      "misses": rows[-1]["misses"] if rows else 0, "retries": rows[-1]["retries"] if rows else 0,
                      "failed_loads": rows[-1]["failed_loads"] if rows else 0, "lossless_first_session": checked,
                      "io_threads_alive": alive, "error": error}))


if __name__ == "__main__":
    main()
