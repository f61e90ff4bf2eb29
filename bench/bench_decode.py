"""Decode speed of the offloaded model against stock mlx-lm, same checkpoint, one run.

Physics: a decode step reads every resident weight once plus top_k experts per MoE
layer. Fully resident (stock) pays no I/O; at a budget below 100% a step pays for
its misses (bytes from the page cache or SSD). "auto" runs what `specmoe generate` runs
(runtime/decode/plain.py): at a budget that holds every expert, device passes (expert lookups on
the device, one host sync per token like stock, one more per repair); below it, mlx-lm's
generate_step on the per-layer synced path. "on": device passes at any budget. With files hot, a
miss costs a memory copy. Targets: >= 0.97x at 100%, 0.92x at 50%, 0.8x at 25%.

Variants, all greedy on the same prompts, files hot (one warmup run first):
stock mlx-lm fully resident, and specmoe at 100%, 50% and 25% budgets ("next off": the same
without building forward n+1 before forward n's sync, runtime/decode/next_forward.py). Ratios are paired:
in each trial every variant runs once, in a fresh order, and each of its prompts runs back to back with the
same prompt on stock (which first, at random), so drift on this shared machine hits both alike; a trial's
ratio is the variant's tok/s over its stock partner's, reported as median and min-max. "stock (A/A
control)" is a second stock model paired the same way: its spread is the run's noise floor. Prints a table and ends with one JSON line.
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
from runtime.decode import holds_every_expert, offloaded_generate_step  # noqa: E402
from runtime.decode.warm import warm_start  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402

CONTROL = "stock (A/A control)"
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
]


def _counters(om) -> dict:
    return {**om.counters(), "host_syncs": om.cache.host_syncs}


def decode_prompt(model, tokenizer, prompt: str, n_tokens: int, om=None, one_sync: str = "auto",
                  build_next: bool = True) -> dict:
    """One prompt's decode: tokens decoded after the first, wall and CPU seconds, and the offloaded model's
    misses, bytes read, host syncs and repairs over them."""
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731  (generate_step's default)
    ids = mx.array(tokenizer.encode(prompt))
    dp = None
    if om is not None:
        warm_start(om)
    if om is not None and (one_sync == "on" or one_sync == "auto" and holds_every_expert(om)):
        from runtime.decode import DevicePass

        dp = DevicePass(om, build_next=build_next)
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
    run = {"tokens": n, "wall": time.perf_counter() - t0, "cpu": time.process_time() - p0,
           "misses": 0, "bytes_read": 0, "host_syncs": n, "repairs": 0}
    if om:
        c1 = _counters(om)
        run.update(misses=c1["misses"] - c0["misses"], bytes_read=c1["bytes_read"] - c0["bytes_read"],
                   host_syncs=at_last[0] - c0["host_syncs"], repairs=at_last[1] - r0)
    return run


def summarize(runs: list[dict]) -> tuple[float, dict]:
    """tok/s over `runs` (all decoded tokens / all decode time) and per decoded token: misses, MB read,
    host syncs, repairs, CPU ms."""
    decoded = sum(r["tokens"] for r in runs)
    total = {k: sum(r[k] for r in runs) for k in ("wall", "cpu", "misses", "bytes_read", "host_syncs", "repairs")}
    per = {"misses_per_token": total["misses"] / decoded, "mb_read_per_token": total["bytes_read"] / decoded / 1e6,
           "host_syncs_per_token": total["host_syncs"] / decoded, "repairs_per_token": total["repairs"] / decoded,
           "cpu_ms_per_token": total["cpu"] / decoded * 1e3}
    return decoded / total["wall"], per


def decode_tps(model, tokenizer, n_tokens: int, om=None, one_sync: str = "auto",
               build_next: bool = True) -> tuple[float, dict]:
    """Decode tok/s over PROMPTS (all decoded tokens / all decode time); per decoded token: misses,
    MB read, host syncs, repairs, CPU ms."""
    return summarize([decode_prompt(model, tokenizer, p, n_tokens, om, one_sync, build_next) for p in PROMPTS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build a synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--one-sync", default="auto,on",
                    help="comma list of: auto (as `specmoe generate` runs: device passes at a budget holding every "
                         "expert, else one sync per MoE layer), on (device passes, one sync + one per repair), off (one "
                         "host sync per MoE layer); each is a variant per budget below 100%%")
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
        # The A/A control: a second stock model, measured against stock like every variant. Its spread is the
        # noise of this run's pairing: a variant within it is not slower or faster than stock.
        variants = [("stock", None, None, True), (CONTROL, None, None, True)]
        for b in args.budgets.split(","):  # at 100% there is no repair: the modes but "off" run alike
            for m in (modes[:1] if b == "100%" and "off" not in modes else modes):
                name = f"specmoe {b}" + (f" {m}" if len(modes) > 1 and b != "100%" else "")
                variants.append((name, b, m, True))
                for suffix, budgets, applies, options in ablations:
                    if b in budgets and m in applies:
                        variants.append((f"{name} {suffix}", b, m, options["build_next"]))
        loaded = {}
        for name, budget, mode, build_next in variants:
            if budget is None:
                model, tok = load(str(path))
                loaded[name] = (model, tok, None, None, True)
            else:
                om = OffloadedModel.load(path, OffloadConfig(budget=budget))
                loaded[name] = (om.model, om.tokenizer, om, mode, build_next)
        for model, tok, om, mode, build_next in loaded.values():  # warmup: files hot, kernels built
            decode_tps(model, tok, 8, om, mode, build_next)
        samples = {name: [] for name, *_ in variants}  # per trial: (variant's tok/s, its stock partner's)
        io = {name: [] for name, *_ in variants}  # per trial: (variant's per-token counts, its stock partner's)
        rng = random.Random(0)
        for _ in range(args.trials):
            order = [name for name, *_ in variants if name != "stock"]
            rng.shuffle(order)  # no variant always runs right after the same one (its garbage, its evictions)
            for name in order:
                # Paired: each prompt runs on this variant and on stock back to back, in a random order, so the
                # machine's drift (other tenants, clocks) hits both alike; their ratio is this trial's sample.
                runs = {name: [], "stock": []}
                for prompt in PROMPTS:
                    pair = [name, "stock"]
                    rng.shuffle(pair)
                    for who in pair:
                        model, tok, om, mode, build_next = loaded[who]
                        runs[who].append(decode_prompt(model, tok, prompt, args.tokens, om, mode, build_next))
                (tps, per), (stock_tps, stock_per) = summarize(runs[name]), summarize(runs["stock"])
                samples[name].append((tps, stock_tps))
                io[name].append((per, stock_per))
                samples["stock"].append((stock_tps, stock_tps))
                io["stock"].append((stock_per, stock_per))
        expert_mb = None
        for _, _, om, *_ in loaded.values():
            if om:
                expert_mb = om.store.expert_bytes_total / 1e6
                om.close()

    lines = [f"model: {args.model or 'synthetic qwen3_moe, 8 layers x 64 experts, top-4'} ({expert_mb:.1f} MB of experts); "
             f"greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, {args.trials} trials (variants in a fresh order each; "
             f"each prompt run on the variant and on stock back to back, in a random order: a ratio is that pair's), "
             f"files hot, {CONTROL!r} is a second stock model (the pairing's noise), "
             f"one-sync modes: {args.one_sync} (auto: device passes while the budget holds every expert, else one sync per MoE layer; on: one sync + one per "
             f"repair; off: one sync per MoE layer); load average {load0:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end",
             f"{'variant':<26}{'tok/s':>9}{'vs stock (min-max)':>24}{'CPU ms/tok':>11}{'CPU vs stock (min-max)':>26}"
             f"{'misses/tok':>12}{'MB read/tok':>13}{'syncs/tok':>11}{'repairs/tok':>13}"]
    results = {}
    for name, *_ in variants:
        tps = statistics.median(t for t, _ in samples[name])
        ratios = [t / st for t, st in samples[name]]
        # CPU time per token (this process, all threads): work done, less sensitive to other tenants than wall time.
        cpu_ratios = [sp["cpu_ms_per_token"] / p["cpu_ms_per_token"] for p, sp in io[name]]
        per = {k: statistics.mean(p[k] for p, _ in io[name]) for k in io[name][0][0]}
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
                             "one_sync": args.one_sync, "load_average": [load0, os.getloadavg()[0]], "tokens": args.tokens, "trials": args.trials, "order": "shuffled per trial, each prompt paired with a stock run", "results": results}))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
