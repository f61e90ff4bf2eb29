"""Speculative decoding with expert prefetch against plain offloaded decoding, one run.

Physics: at a budget below 100%, plain decoding stalls on every expert miss. A
speculative round verifies K+1 tokens in one target pass, so each unique expert
of the window is read once for several tokens; and while the drafter runs, a
predictor forecasts the window's experts so the loader can read them before the
verify pass asks. What the drafter costs and how often it is right decide
whether this pays. Reads go through O_DIRECT by default so misses cost real disk
time here, as SSD reads do on a Mac.

Variants, all greedy on the same prompts, each starting from an empty cache (the
oracle's recording run included: its cache is emptied before the measured run):
no-spec, spec+none, spec+previous, spec+spmoe, spec+oracle, at each budget. The
variants of one prompt run back to back, in a fresh order each pass, and "vs
no-spec" is the median of those per-prompt ratios with its min-max, so load from
other tenants of the machine mostly cancels and what remains shows as spread.
Prompts come from bench/prompts.txt: written for the bench, not taken from the
embedded pair's training text (runtime/data/tiny/card.json), so recall and
acceptance are held-out figures.
The target is packed (`specmoe convert`) into a temporary store first: one read
per expert, as the runtime is meant to be used. Prints a table and ends with one
JSON line.
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
from runtime.decode import load_drafter  # noqa: E402
from runtime.checkpoints import embedded_pair  # noqa: E402
from runtime.decode import generate_tokens  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402
from runtime.decode import run_speculative  # noqa: E402
from storage.packer import convert  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.txt"
VARIANTS = ["no-spec", "none", "previous", "spmoe", "oracle"]


def run_once(target: Path, draft: Path, variant: str, budget: str, prompt: str, args) -> dict:
    """One prompt, one variant, from an empty cache: raw counts of the run."""
    inject = f"slow:ms={args.emulate_read_ms}" if args.emulate_read_ms else ""
    om = OffloadedModel.load(target, OffloadConfig(budget=budget, io_mode=args.io_mode, threads=args.threads,
                                                   inject=inject))
    try:
        ids = list(om.tokenizer.encode(prompt))
        cpu0 = time.process_time()  # this process's CPU time, loader threads included; less moved by other tenants than wall time
        if variant == "no-spec":
            _, stats = generate_tokens(om.model, ids, max_tokens=args.tokens, om=om)
            n = stats.n_tokens - 1  # the first token comes from prefill
            return {"tokens_per_s": stats.tokens_per_s, "tokens": n, "misses": stats.misses_per_token * n,
                    "cpu_ms_per_token": (time.process_time() - cpu0) * 1e3 / stats.n_tokens,
                    "mb": stats.mb_read_per_token * n, "syncs_per_token": stats.host_syncs_per_token,
                    "repairs_per_token": stats.repairs_per_token}
        dmodel, dconfig = load_drafter(draft, om)
        predictor, _, route = variant.partition("/")  # spmoe/off: verify windows never routed
        cpu0 = time.process_time()  # loading the drafter is not decoding
        _, stats, layers = run_speculative(om, draft, ids, max_tokens=args.tokens, num_draft=args.num_draft,
                                           predictor=predictor, cutoff=args.cutoff, draft_model=dmodel,
                                           draft_config=dconfig, one_sync=args.one_sync,
                                           forecast_limit=args.forecast_limit,
                                           adaptive_k=not args.fixed_k, route=route or "auto")
        # the oracle's CPU time includes its recording run (run_speculative records, then decodes): not comparable
        cpu_ms_per_token = None if predictor == "oracle" else (time.process_time() - cpu0) * 1e3 / stats.n_tokens
        c = stats.counters
        forecast = sum(s.forecast for l, s in stats.per_layer.items() if l in layers)
        return {"tokens_per_s": stats.n_tokens / stats.decode_s, "tokens": stats.n_tokens, "misses": c["misses"],
                "cpu_ms_per_token": cpu_ms_per_token,
                "mb": c["bytes_read"] / 1e6, "acceptance": stats.acceptance,
                "tokens_per_verify": stats.tokens_per_verify, "recall": stats.recall(layers or None),
                "precision": stats.precision(layers or None),
                "forecast_per_layer": forecast / max(1, stats.n_rounds * len(layers)),
                "one_sync_share": (stats.one_sync_tries - stats.one_sync_fallbacks) / max(1, stats.n_rounds),
                "mean_k": stats.mean_k, "syncs_per_round": stats.host_syncs / max(1, stats.one_sync_tries),
                "repairs_per_round": stats.repairs / max(1, stats.one_sync_tries),
                "routed_share": stats.routed_rounds / max(1, stats.one_sync_tries),
                "round": {"rounds": stats.n_rounds, "draft_ms": stats.draft_s * 1e3, "verify_ms": stats.verify_s * 1e3,
                          "wait_ms": c["load_wait_ms"], **stats.window_reads.to_json()}}
    finally:
        om.close()


def summarise(runs: list[dict], base: list[dict] | None, n_prompts: int = 1) -> dict:
    """Median tok/s over prompt runs; vs no-spec = median of per-run ratios to no-spec on the same
    prompt and repeat (variants of a prompt run back to back, so machine drift mostly cancels).
    Runs are in pass order, prompts inner: per_prompt is each prompt's median ratio over the passes."""
    tokens = sum(r["tokens"] for r in runs)
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base)] if base else None
    cpu = ([b["cpu_ms_per_token"] / r["cpu_ms_per_token"] for r, b in zip(runs, base)]
           if base and runs[0]["cpu_ms_per_token"] is not None else None)
    verdict = None
    if ratios:  # faster or slower only when every prompt run says so
        verdict = "faster" if min(ratios) > 1 else "slower" if max(ratios) < 1 else "within the noise"
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
           "vs_no_spec": statistics.median(ratios) if ratios else None,
           "vs_no_spec_min": min(ratios) if ratios else None, "vs_no_spec_max": max(ratios) if ratios else None,
           "verdict": verdict,
           "cpu_ms_per_token": (statistics.median(r["cpu_ms_per_token"] for r in runs)
                                if runs[0]["cpu_ms_per_token"] is not None else None),
           "cpu_vs_no_spec": statistics.median(cpu) if cpu else None,
           "cpu_vs_no_spec_min": min(cpu) if cpu else None, "cpu_vs_no_spec_max": max(cpu) if cpu else None,
           "n_runs": len(runs), "ratios": ratios,
           "per_prompt": ([statistics.median(ratios[i::n_prompts]) for i in range(n_prompts)] if ratios else None),
           "per_prompt_acceptance": ([statistics.mean(r["acceptance"] for r in runs[i::n_prompts]) for i in range(n_prompts)]
                                     if runs[0].get("acceptance") is not None else None),
           "misses_per_token": sum(r["misses"] for r in runs) / tokens,
           "mb_read_per_token": sum(r["mb"] for r in runs) / tokens}
    for key in ("acceptance", "tokens_per_verify", "recall", "precision", "forecast_per_layer", "one_sync_share", "mean_k",
                "syncs_per_round", "repairs_per_round", "routed_share", "syncs_per_token", "repairs_per_token"):
        out[key] = statistics.mean(r[key] for r in runs) if key in runs[0] else None
    if "round" in runs[0]:  # where a round goes, over all runs: totals per round (window_reads: per counted window)
        tot = {k: sum(r["round"][k] for r in runs) for k in runs[0]["round"]}
        per_round = {k: tot[k] / max(1, tot["rounds"]) for k in ("draft_ms", "verify_ms", "wait_ms")}
        reads = {k: tot[k] / max(1, tot["windows"]) for k in ("first_only", "middle_only", "last_only", "shared", "unrouted", "total")}
        out["per_round"] = {**per_round, "verify_reads": reads, "windows": tot["windows"], "rounds": tot["rounds"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="target (default: the embedded trained MoE)")
    ap.add_argument("--draft", type=Path, default=None, help="drafter (default: the embedded drafter)")
    ap.add_argument("--budgets", default="50%,25%")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--cutoff", type=int, default=None)
    ap.add_argument("--fixed-k", action="store_true", help="always propose K (default: adaptive K, down to plain rounds)")
    ap.add_argument("--io-mode", default="direct", choices=["buffered", "direct"])
    ap.add_argument("--raw", action="store_true",
                    help="read the mlx-lm checkpoint directly (several reads per expert) instead of a packed "
                         "store made by `specmoe convert` in a temporary directory (one read per expert)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--one-sync", default="auto", choices=["auto", "on", "off"],
                    help="auto/on: verifies as device passes (runtime/decode/device_pass.py); off: one host sync per MoE layer")
    ap.add_argument("--forecast-limit", type=int, default=None,
                    help="experts forecast per layer per round at most (default 2k)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (more: steadier medians)")
    ap.add_argument("--prompts", type=Path, default=PROMPTS_FILE, help="one prompt per line (default: bench/prompts.txt)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
                    + "; /off: verify windows never routed (runtime/decode/window_routes.py), e.g. spmoe/off")
    ap.add_argument("--emulate-read-ms", type=float, default=0.0,
                    help="add this latency to every expert read (emulates an SSD slower than this machine's; "
                         "results are then labelled emulated)")
    args = ap.parse_args()
    pair = embedded_pair()
    target, draft = args.model or pair.target, args.draft or pair.default_drafter
    scratch = None
    if not args.raw:
        scratch = tempfile.TemporaryDirectory(prefix="specmoe-bench-")
        source, target = target, convert(target, Path(scratch.name) / target.name)

    variants = args.variants.split(",")
    prompts = [l.strip() for l in args.prompts.read_text().splitlines() if l.strip()]
    results = {}
    load0 = os.getloadavg()
    for budget in args.budgets.split(","):
        runs = {v: [] for v in variants}
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                order = random.Random(rep * 1000 + i).sample(variants, len(variants))  # no variant always runs first
                for variant in order:  # back to back on one prompt: drift hits all variants alike
                    runs[variant].append(run_once(target, draft, variant, budget, prompt, args))
        for variant in variants:
            base = runs.get("no-spec")
            results[f"{budget} {variant}"] = summarise(runs[variant], base, len(prompts))
    print(f"target {target.name}, drafter {draft.name}; greedy, {args.tokens} tokens x {len(prompts)} prompts, "
          f"K={args.num_draft}, io={args.io_mode}, {'raw checkpoint' if args.raw else 'packed store'}, {args.repeats} pass(es); "
          "tok/s: median over runs; vs no-spec: median [min-max] of per-prompt ratios (verdict: faster/slower only "
          "when every prompt run says so); CPU: no-spec's CPU ms/token over the variant's, same prompt and pass (not for the "
          "oracle, whose CPU time includes its recording run); load "
          f"average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
          + (f"; EMULATED read latency +{args.emulate_read_ms} ms per expert" if args.emulate_read_ms else ""))
    print(f"{'budget variant':<22}{'tok/s':>8}{'vs no-spec [min-max]':>22}{'verdict':>17}{'CPU vs no-spec':>20}{'misses/tok':>12}{'MB/tok':>9}{'accept':>8}{'tok/verify':>11}"
          f"{'recall':>8}{'precis.':>8}{'fc/layer':>9}{'1-sync':>8}{'routed':>8}{'K':>7}")
    for key, r in results.items():
        fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
        spread = f"{r['vs_no_spec']:.2f} [{r['vs_no_spec_min']:.2f}-{r['vs_no_spec_max']:.2f}]" if r["vs_no_spec"] else "-"
        cpu = (f"{r['cpu_vs_no_spec']:.2f} [{r['cpu_vs_no_spec_min']:.2f}-{r['cpu_vs_no_spec_max']:.2f}]"
               if r["cpu_vs_no_spec"] and not key.endswith(" no-spec") else "-")
        verdict = r["verdict"] if r["verdict"] and not key.endswith(" no-spec") else "-"
        print(f"{key:<22}{r['tokens_per_s']:>8.1f}{spread:>22}{verdict:>17}{cpu:>20}{r['misses_per_token']:>12.2f}"
              f"{r['mb_read_per_token']:>9.3f}{fmt(r['acceptance'], '{:.0%}'):>8}{fmt(r['tokens_per_verify'], '{:.2f}'):>11}"
              f"{fmt(r['recall'], '{:.2f}'):>8}{fmt(r['precision'], '{:.2f}'):>8}"
              f"{fmt(r['forecast_per_layer'], '{:.1f}'):>9}{fmt(r['one_sync_share'], '{:.0%}'):>8}"
              f"{fmt(r['routed_share'], '{:.0%}'):>8}{fmt(r['mean_k'], '{:.2f}'):>7}")
    if args.repeats > 1:  # is the median one prompt's story? (each prompt's median ratio over the passes, its acceptance)
        for key, r in results.items():
            if r["per_prompt"] and not key.endswith(" no-spec"):
                acc = r["per_prompt_acceptance"] or [None] * len(r["per_prompt"])
                print(f"{key}: per prompt, median vs no-spec (acceptance) " + ", ".join(
                    f"{x:.2f}" + (f" ({a:.0%})" if a is not None else "") for x, a in zip(r["per_prompt"], acc)))
    rounds = {k: r["per_round"] for k, r in results.items() if r.get("per_round")}
    if rounds:
        print("where a round goes (totals over all runs, per round; verify reads per window of 2+ tokens, by the window "
              "tokens that routed to them: only the first (pending), only one middle draft, only the last draft d_K -- "
              "which the drafter never fed, so no forecast named it --, two or more, none; "
              "runtime/decode/window_reads.py)")
        print(f"{'budget variant':<22}{'draft ms':>10}{'verify ms':>11}{'read wait':>11}{'verify reads':>14}{'first':>7}"
              f"{'middle':>8}{'last':>7}{'shared':>8}{'none':>6}{'last share':>12}")
        for key, p in rounds.items():
            v = p["verify_reads"]
            print(f"{key:<22}{p['draft_ms']:>10.2f}{p['verify_ms']:>11.2f}{p['wait_ms']:>11.2f}{v['total']:>14.2f}"
                  f"{v['first_only']:>7.2f}{v['middle_only']:>8.2f}{v['last_only']:>7.2f}{v['shared']:>8.2f}{v['unrouted']:>6.2f}"
                  f"{(v['last_only'] / v['total'] if v['total'] else 0):>12.0%}")
    print(json.dumps({"bench": "speculative", "target": str(source if scratch else target), "packed": not args.raw, "draft": str(draft), "num_draft": args.num_draft,
                      "io_mode": args.io_mode, "emulated_read_ms": args.emulate_read_ms, "tokens": args.tokens,
                      "one_sync": args.one_sync, "adaptive_k": not args.fixed_k,
                      "forecast_limit": args.forecast_limit, "repeats": args.repeats, "prompts": prompts,
                      "load_avg": [load0, os.getloadavg()],
                      "results": results}))
    if scratch is not None:
        scratch.cleanup()


if __name__ == "__main__":
    main()
