"""One MoE layer over a verify window of T = 1..8 tokens: stock SwitchGLU vs the grouped reference
vs (on Metal) the dedup kernel, at Qwen3-30B-A3B shapes.

Physics: one MoE layer of a decode step does 3 * D * H multiply-adds per (token, expert)
pair against weights it must stream from memory: at 4-bit, group 64, an expert is ~2.4 MB
of codes plus its scales and biases. A single-token step is bandwidth-bound on Apple GPUs
(2 multiply-adds per weight byte at 4 bits), so its time is bytes / bandwidth. A verify window of T tokens
has P = T * k pairs but only U unique experts (published: 20.4 for 4 x top-8 of 128, where
uniform routing would give 28.8). Stock mlx-lm streams an expert once per pair below 64
pairs (Metal's grouped path also wants ~4 pairs per expert), so its expert time grows like
P / k = T; a kernel that reads each unique expert once grows like U / k. That ratio,
T(K+1)/T(1) of the expert part, is what decides whether verifying K drafted tokens is cheap.

On the CPU backend (this repository's CI) the layer is compute-bound instead: MLX's CPU
quantized matmul dequantizes and multiplies every weight once per row, so stock and
reference both do P row-matvecs and both grow like T; grouping only improves locality.
The CPU columns are measured as is; the "bandwidth-bound U/k" column is a projection, not
a measurement. Bytes columns: `MB pairs` = P * expert bytes (what per-pair streaming reads),
`MB unique` = U * expert bytes (what a dedup kernel reads). GMAC/s = P * 3 * D * H / time.

Method: random quantized codes (timing does not depend on values), router-like skewed
routing (token t's experts do not depend on T), float32 activations and scales, one
warmup round and N timed rounds, each round timing every point and variant once
(interleaved, so a busy neighbour slows all alike), median per point. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from metal.dedup_verify import (  # noqa: E402
    group_by_expert, grouped_metal, max_error, moe_verify_reference, weights_from_slab)
from metal.selfcheck import make_routing, random_slab, stock_switch_glu  # noqa: E402
from runtime.observe import uniform_unique_experts  # noqa: E402


def expert_bytes(slab: dict[str, mx.array]) -> int:
    return sum(a.nbytes // a.shape[0] for a in slab.values())


def _window_fns(x, inds, scores, switch, slab, weights, q, d_model) -> dict:
    def stock():
        return (switch(x, inds) * scores[..., None]).sum(axis=-2)

    def reference():
        return moe_verify_reference(x, inds, scores, slab, **q)

    def kernel():
        g = group_by_expert(inds)
        y = grouped_metal(x[0], g, weights)[g.inv_order].reshape(*inds.shape, d_model)
        return (y * scores[..., None]).sum(axis=-2)

    fns = {"stock": stock, "reference": reference}
    if mx.metal.is_available():
        fns["kernel"] = kernel
    return fns


def _timed_ms(fn) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t0) * 1e3


def measure(args) -> dict:
    q = dict(group_size=args.group_size, bits=args.bits)
    slab = random_slab(args.experts, args.d_model, args.hidden, dtype=mx.float32, seed=args.seed, **q)
    switch = stock_switch_glu(slab, **q)
    weights = weights_from_slab(slab, **q)
    metal = mx.metal.is_available()
    per_expert = expert_bytes(slab)
    macs_per_pair = 3 * args.d_model * args.hidden
    ids, raw_scores = make_routing(args.max_tokens, args.top_k, args.experts, "skewed", seed=args.seed, skew=args.skew)
    x_all = mx.random.normal((1, args.max_tokens, args.d_model), key=mx.random.key(args.seed))
    points = {}  # tokens -> {variant: fn}
    for tokens in range(1, args.max_tokens + 1):
        x, inds, scores = x_all[:, :tokens], mx.array(ids[:tokens])[None], mx.array(raw_scores[:tokens])[None]
        points[tokens] = _window_fns(x, inds, scores, switch, slab, weights, q, args.d_model)
    # Trials are interleaved (every point and variant once per round) so that a noisy
    # neighbour on the machine slows all of them alike instead of skewing one point.
    times = {(t, v): [] for t, fns in points.items() for v in fns}
    for round_ in range(args.warmup + args.trials):
        for (tokens, variant), samples in times.items():
            ms = _timed_ms(points[tokens][variant])
            if round_ >= args.warmup:
                samples.append(ms)
        print(f"  round {round_ + 1}/{args.warmup + args.trials}", file=sys.stderr)
    rows = []
    for tokens, fns in points.items():
        n_pairs, n_unique = tokens * args.top_k, len(set(ids[:tokens].reshape(-1).tolist()))
        row = {"tokens": tokens, "pairs": n_pairs, "unique": n_unique,
               "uniform_unique": round(uniform_unique_experts(args.experts, args.top_k, tokens), 1),
               "mb_pairs": n_pairs * per_expert / 1e6, "mb_unique": n_unique * per_expert / 1e6}
        for variant in ("stock", "reference", "kernel"):
            samples = times.get((tokens, variant))
            row[f"{variant}_ms"] = statistics.median(samples) if samples else None
        if metal:  # the bench times the kernel; selfcheck owns correctness, but a wrong fast kernel must show
            row["kernel_max_error"] = max_error(fns["kernel"](), fns["reference"]())
        row["gmacs_stock"] = n_pairs * macs_per_pair / row["stock_ms"] / 1e6
        row["gmacs_reference"] = n_pairs * macs_per_pair / row["reference_ms"] / 1e6
        rows.append(row)
    # Ratios are taken within one round (T against T=1, stock against reference), then summarized as
    # median [min-max] over rounds: a busy neighbour during one round moves that round's pair together.
    for row in rows:
        for variant in ("stock", "reference", "kernel"):
            samples, base = times.get((row["tokens"], variant)), times.get((1, variant))
            if samples is None:
                row[f"{variant}_ratio"] = row[f"{variant}_ratio_min"] = row[f"{variant}_ratio_max"] = None
                continue
            per_round = [a / b for a, b in zip(samples, base)]
            row[f"{variant}_ratio"] = statistics.median(per_round)
            row[f"{variant}_ratio_min"], row[f"{variant}_ratio_max"] = min(per_round), max(per_round)
            row[f"{variant}_ms_min"], row[f"{variant}_ms_max"] = min(samples), max(samples)
        per_round = [a / b for a, b in zip(times[(row["tokens"], "stock")], times[(row["tokens"], "reference")])]
        row["stock_over_reference"] = statistics.median(per_round)
        row["stock_over_reference_min"], row["stock_over_reference_max"] = min(per_round), max(per_round)
        lo, hi = row["stock_over_reference_min"], row["stock_over_reference_max"]
        row["reference_verdict"] = ("reference faster" if lo > 1 else "stock faster" if hi < 1
                                    else "within the noise")
        row["bandwidth_bound_ratio"] = row["unique"] / args.top_k  # projection: expert part, dedup, Metal
    return {"bench": "verify", "device": str(mx.default_device()), "metal": metal, "mlx": mx.__version__,
            "shapes": {"d_model": args.d_model, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                       "bits": args.bits, "group_size": args.group_size, "activations": "float32"},
            "expert_bytes": per_expert, "trials": args.trials, "load_avg": os.getloadavg(), "rows": rows}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict) -> None:
    s = result["shapes"]
    print(f"one MoE layer, D={s['d_model']} H={s['hidden']} E={s['experts']} top-{s['top_k']}, {s['bits']}-bit "
          f"group {s['group_size']}, {s['activations']}; expert = {result['expert_bytes'] / 1e6:.2f} MB; "
          f"device {result['device']} (Metal {'yes' if result['metal'] else 'no'}); ms: median of {result['trials']} "
          f"interleaved rounds; ratios: median [min-max] of per-round ratios; load average "
          f"{' '.join(f'{x:.1f}' for x in result['load_avg'])}")
    head = (f"{'T':>2} {'pairs':>5} {'uniq':>4} {'unif':>5} {'MB pairs':>8} {'MB uniq':>7} {'stock ms':>8} "
            f"{'ref ms':>7} {'kern ms':>7} {'stock T/T1 [min-max]':>20} {'ref T/T1 [min-max]':>19} {'kern T/T1':>9} "
            f"{'U/k proj':>8} {'stock/ref [min-max]':>19} {'stock GMAC/s':>12}")
    print(head)
    print("-" * len(head))

    def spread(r, key):
        return "-" if r[key] is None else f"{r[key]:.2f} [{r[key + '_min']:.2f}-{r[key + '_max']:.2f}]"

    for r in result["rows"]:
        print(f"{r['tokens']:>2} {r['pairs']:>5} {r['unique']:>4} {r['uniform_unique']:>5.1f} {r['mb_pairs']:>8.1f} "
              f"{r['mb_unique']:>7.1f} {r['stock_ms']:>8.1f} {r['reference_ms']:>7.1f} {_fmt(r['kernel_ms'], '7.1f'):>7} "
              f"{spread(r, 'stock_ratio'):>20} {spread(r, 'reference_ratio'):>19} {_fmt(r['kernel_ratio'], '9.2f'):>9} "
              f"{r['bandwidth_bound_ratio']:>8.2f} {spread(r, 'stock_over_reference'):>19} {r['gmacs_stock']:>12.2f}")
    one, last = result["rows"][0], result["rows"][-1]
    print(f"napkin: T=1 streams {one['mb_pairs']:.1f} MB in {one['stock_ms']:.1f} ms = "
          f"{one['mb_pairs'] / one['stock_ms']:.2f} GB/s of weights at {one['gmacs_stock']:.2f} GMAC/s; "
          f"a bandwidth-bound device would be limited by bytes, this one by arithmetic.")
    print(f"napkin: T={last['tokens']} needs {last['unique']} unique experts ({last['mb_unique']:.0f} MB) for "
          f"{last['pairs']} pairs ({last['mb_pairs']:.0f} MB): dedup could cut weight traffic "
          f"{last['mb_pairs'] / last['mb_unique']:.1f}x; measured stock/reference time ratio here "
          f"{spread(last, 'stock_over_reference')} ({last['reference_verdict']}).")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=8, help="windows T = 1..max-tokens")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--skew", type=float, default=1.3, help="router popularity std (1.3: ~20 unique for 4 x top-8 of 128)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = measure(args)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
