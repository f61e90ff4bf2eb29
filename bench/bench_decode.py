"""Decode speed of the offloaded model against stock mlx-lm, same checkpoint, one run.

Physics: a decode step reads every resident weight once plus top_k experts per MoE
layer. Fully resident (stock) pays no I/O; at a budget below 100% a step pays for
its misses (bytes from the page cache or SSD). Each step is a device pass
(runtime/decode/device_pass.py): expert lookups on the device, one host sync per token
like stock, plus one per repair when an expert was absent. With files hot, a miss costs a
memory copy. Targets (issue 14): >= 0.97x at 100%, 0.92x at 50%, 0.8x at 25%.

Variants, all greedy on the same prompts, files hot (one warmup run first):
stock mlx-lm fully resident, and specmoe at 100%, 50% and 25% budgets ("next off": the same
without building forward n+1 before forward n's sync, runtime/decode/next_forward.py; "route off": auto
with segment repairs only, no routed forwards, runtime/decode/route_sync.py; "all layers": auto whose forwards
route every layer when they route any, instead of only the layers that miss often enough; "staged off": auto whose
routed forwards sync as they are built, with no next forward built between their route syncs,
runtime/decode/paced_build.py). Ratios are per
trial against the stock run of the same trial (interleaved, every variant once per trial in a fresh
order), reported as median and min-max. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import json
import random
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
from runtime.decode import offloaded_generate_step  # noqa: E402
from runtime.decode.warm import warm_start  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402

PROMPTS = [
    "The history of the river begins in the mountains, where",
    "def load_experts(path):\n    \"\"\"Read every expert",
    "Once upon a time a model was larger than the machine that ran it, and",
]


# Ablation variants: (name suffix, flag, default budgets, the one-sync modes it applies to, decode_tps options, what
# it leaves out). Each runs beside its budget's variant, with one option changed.
ABLATIONS = [
    ("next off", "--next-off", "100%", ("auto", "on"), dict(build_next=False),
     "without building the next forward before the previous one's sync (runtime/decode/next_forward.py)"),
    ("route off", "--route-off", "50%,25%", ("auto",), dict(route=False),
     "\"auto\" without routed layers (segment repairs only; runtime/decode/route_sync.py)"),
    ("all layers", "--route-all", "50%,25%", ("auto",), dict(route="all"),
     "\"auto\" routing every layer of a forward that routes any, instead of only the layers whose misses make a "
     "sync pay (runtime/decode/route_sync.py)"),
    ("staged off", "--staged-off", "50%,25%", ("auto",), dict(staged=False),
     "\"auto\" with routed forwards that sync as they are built, no next forward built between their route syncs "
     "(runtime/decode/paced_build.py)"),
]


def _counters(om) -> dict:
    return {**om.counters(), "host_syncs": om.cache.host_syncs}


def decode_tps(model, tokenizer, n_tokens: int, om=None, one_sync: str = "auto",
               build_next: bool = True, route: bool | str = True, staged: bool = True) -> tuple[float, dict]:
    """Decode tok/s over PROMPTS (all decoded tokens / all decode time); per decoded token: misses,
    MB read, host syncs, repairs."""
    elapsed, cpu, decoded, totals = 0.0, 0.0, 0, {"misses": 0, "bytes_read": 0, "host_syncs": 0, "repairs": 0}
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731  (generate_step's default)
    for prompt in PROMPTS:
        ids = mx.array(tokenizer.encode(prompt))
        dp = None
        if om is not None and one_sync != "off":
            from runtime.decode import DevicePass

            warm_start(om)
            dp = DevicePass(om, segment="auto" if one_sync == "auto" else None, build_next=build_next,
                            route=bool(route), route_all=route == "all", staged=staged)
            gen = offloaded_generate_step(om, ids, max_tokens=n_tokens, sampler=sampler, device_pass=dp,
                                          after_prefill=om.cache.settle_inflight)
        else:
            gen = generate_step(ids, model, max_tokens=n_tokens)
        next(gen)  # prefill + first token: not decode
        c0 = _counters(om) if om else None
        r0 = dp.stats.repairs if dp else 0
        t0, p0 = time.perf_counter(), time.process_time()
        n, at_last = 0, (0, 0)
        for _ in gen:
            n += 1
            if om:  # syncs up to the last token (not the step generate_step computes after it)
                at_last = (om.cache.host_syncs, dp.stats.repairs if dp else 0)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - p0
        if om:
            c1 = _counters(om)
            for k in ("misses", "bytes_read"):
                totals[k] += c1[k] - c0[k]
            totals["host_syncs"] += at_last[0] - c0["host_syncs"]
            totals["repairs"] += at_last[1] - r0
        decoded += n
    per = {"misses_per_token": totals["misses"] / decoded, "mb_read_per_token": totals["bytes_read"] / decoded / 1e6,
           "host_syncs_per_token": totals["host_syncs"] / decoded if om else 1.0,
           "repairs_per_token": totals["repairs"] / decoded, "cpu_ms_per_token": cpu / decoded * 1e3}
    return decoded / elapsed, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build a synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--one-sync", default="auto,on",
                    help="comma list of: auto (device passes that sync before the layers whose misses make it pay, "
                         "as `specmoe generate` runs them), on (device passes, one sync + one per repair), off (one host "
                         "sync per MoE layer); each is a variant per budget below 100%%")
    for _, flag, default, _, _, what in ABLATIONS:
        ap.add_argument(flag, default=default,
                        help=f"comma list of budgets that also run a variant {what}; empty: none (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and JSON line to this file")
    args = ap.parse_args()
    modes = args.one_sync.split(",")
    if not modes or any(m not in ("auto", "on", "off") for m in modes):
        ap.error(f"--one-sync {args.one_sync!r}; expected a comma list of auto, on, off")
    load0 = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        ablations = [(suffix, [b for b in getattr(args, flag[2:].replace("-", "_")).split(",") if b], applies, options)
                     for suffix, flag, _, applies, options, _ in ABLATIONS]
        base = dict(build_next=True, route=True, staged=True)
        variants = [("stock", None, None, True, True, True)]
        for b in args.budgets.split(","):  # at 100% there is no repair: the modes but "off" run alike
            for m in (modes[:1] if b == "100%" and "off" not in modes else modes):
                name = f"specmoe {b}" + (f" {m}" if len(modes) > 1 and b != "100%" else "")
                variants.append((name, b, m, True, True, True))
                for suffix, budgets, applies, options in ablations:
                    if b in budgets and m in applies:
                        o = {**base, **options}
                        variants.append((f"{name} {suffix}", b, m, o["build_next"], o["route"], o["staged"]))
        loaded = {}
        for name, budget, mode, build_next, route, staged in variants:
            if budget is None:
                model, tok = load(str(path))
                loaded[name] = (model, tok, None, None, True, True, True)
            else:
                om = OffloadedModel.load(path, OffloadConfig(budget=budget))
                loaded[name] = (om.model, om.tokenizer, om, mode, build_next, route, staged)
        for model, tok, om, mode, build_next, route, staged in loaded.values():  # warmup: files hot, kernels built
            decode_tps(model, tok, 8, om, mode, build_next, route, staged)
        samples = {name: [] for name, *_ in variants}
        io = {}
        rng = random.Random(0)
        for _ in range(args.trials):  # interleave variants so drift hits all alike, in a fresh order each trial
            order = [name for name, *_ in variants]
            rng.shuffle(order)  # no variant always runs right after the same one (its garbage, its evictions)
            for name in order:
                model, tok, om, mode, build_next, route, staged = loaded[name]
                tps, per = decode_tps(model, tok, args.tokens, om, mode, build_next, route, staged)
                samples[name].append(tps)
                io.setdefault(name, []).append(per)
        expert_mb = None
        for _, _, om, *_ in loaded.values():
            if om:
                expert_mb = om.store.expert_bytes_total / 1e6
                om.close()

    lines = [f"model: {args.model or 'synthetic qwen3_moe, 8 layers x 64 experts, top-4'} ({expert_mb:.1f} MB of experts); "
             f"greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, {args.trials} interleaved trials (a fresh order each), files hot, "
             f"one-sync modes: {args.one_sync} (auto: a sync before the experts of each layer whose misses make it pay, repairs for the rest; on: one sync + one per "
             f"repair; off: one sync per MoE layer); load average {load0:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end",
             f"{'variant':<26}{'tok/s':>9}{'vs stock (min-max)':>24}{'CPU ms/tok':>11}{'CPU vs stock (min-max)':>26}"
             f"{'misses/tok':>12}{'MB read/tok':>13}{'syncs/tok':>11}{'repairs/tok':>13}"]
    results = {}
    for name, *_ in variants:
        tps = statistics.median(samples[name])
        ratios = [a / b for a, b in zip(samples[name], samples["stock"])]
        # CPU time per token (this process, all threads): work done, less sensitive to other tenants than wall time.
        cpu_ratios = [b["cpu_ms_per_token"] / a["cpu_ms_per_token"] for a, b in zip(io[name], io["stock"])]
        per = {k: statistics.mean(p[k] for p in io[name]) for k in io[name][0]}
        results[name] = {"tokens_per_s": tps, "ratio_vs_stock": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
                         "cpu_ratio_vs_stock": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
                         "cpu_ratio_max": max(cpu_ratios), **per}
        lines.append(f"{name:<26}{tps:>9.1f}{statistics.median(ratios):>10.2f} ({min(ratios):.2f}-{max(ratios):.2f}){'':>3}"
                     f"{per['cpu_ms_per_token']:>11.2f}{statistics.median(cpu_ratios):>12.2f} "
                     f"({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}){'':>3}"
                     f"{per['misses_per_token']:>12.2f}{per['mb_read_per_token']:>13.3f}"
                     f"{per['host_syncs_per_token']:>11.2f}{per['repairs_per_token']:>13.2f}")
    lines.append(json.dumps({"bench": "decode", "model": str(args.model or "synthetic qwen3_moe 8x64 experts"),
                             "one_sync": args.one_sync, "load_average": [load0, os.getloadavg()[0]], "tokens": args.tokens, "trials": args.trials, "order": "shuffled per trial", "results": results}))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
