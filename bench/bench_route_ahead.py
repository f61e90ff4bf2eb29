"""Route syncs that prefetch ahead (runtime/decode/route_ahead.py) against route syncs that do not, one run.

Physics: below a 100% budget plain decoding misses often enough that each MoE layer syncs its lookup codes
before its experts run (routed forwards, runtime/decode/route_sync.py) and reads what is absent right
there, while nothing computes. Prefetching ahead forecasts the next layers from each layer's input at that
same sync and queues their absent experts, so a read overlaps compute instead of stalling it. It can only
pay where a read costs more than the few device ops of a forecast: "auto" turns it on while the measured
read time is at least route_ahead.MIN_READ_MS. Here reads hit the page cache (~0.05-0.2 ms per expert),
so the rows with latency added to every read (EMULATED, storage/faults.py "slow") stand for an SSD.

Variants, greedy on the embedded target (packed, O_DIRECT reads), each run from a fresh model (an empty
cache: no variant starts warmer than its rival): route-ahead off and on (forced, so its cost shows where it
does not pay), interleaved in a fresh order per prompt and pass. "vs off" is the median [min-max] of the
per-prompt, per-pass tok/s ratios (faster/slower only when every ratio says so). Counts per decoded token:
read wait (ms the decoder was blocked on reads), demand reads (experts a layer waited for at its route sync
or a repair read), prefetched (queued ahead) and used (prefetched experts a layer then found), host syncs.
Prints a table and ends with one JSON line.
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
import mlx.core as mx  # noqa: E402

from runtime.checkpoints import embedded_pair  # noqa: E402
from runtime.decode import DevicePass, OffloadConfig, OffloadedModel, offloaded_generate_step  # noqa: E402
from storage.packer import convert  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.txt"
VARIANTS = ("off", "on")


def run_once(store: Path, budget: str, ms: float, variant: str, prompt: str, tokens: int, threads: int) -> dict:
    """One prompt from an empty cache: decode time and counts, the first (prefill) token left out."""
    om = OffloadedModel.load(store, OffloadConfig(budget=budget, io_mode="direct", threads=threads,
                                                  inject=f"slow:ms={ms}" if ms else ""))
    try:
        dp = DevicePass(om, segment="auto", route_ahead=variant)
        gen = offloaded_generate_step(om, mx.array(om.tokenizer.encode(prompt)), max_tokens=tokens,
                                      sampler=lambda x: mx.argmax(x, axis=-1), device_pass=dp)
        next(gen)
        c0, w0, s0 = om.counters(), om.loader.stats.wait_ms, dp.stats.to_json()
        t0, p0 = time.perf_counter(), time.process_time()
        n = sum(1 for _ in gen)
        wall, cpu = time.perf_counter() - t0, time.process_time() - p0
        c1, s1 = om.counters(), dp.stats.to_json()
        d = {k: s1[k] - s0[k] for k in ("route_reads", "repair_reads", "ahead_prefetched", "host_syncs", "routed",
                                          "passes")}
        return {"tokens_per_s": n / wall, "cpu_ms": cpu * 1e3 / n, "wait_ms": (om.loader.stats.wait_ms - w0) / n,
                "demand_reads": (d["route_reads"] + d["repair_reads"]) / n, "prefetched": d["ahead_prefetched"] / n,
                "used": (c1["prefetch_hits"] - c0["prefetch_hits"]) / n, "syncs": d["host_syncs"] / n,
                "routed": d["routed"] / max(1, d["passes"])}
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="50%,25%", help="comma list of expert-cache budgets (default 50%%,25%%)")
    ap.add_argument("--emulate-read-ms", default="0,1,2",
                    help="comma list of ms added to every expert read (0: real reads; others EMULATED)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per prompt (default 48)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts from bench/prompts.txt (default 4)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    ap.add_argument("--threads", type=int, default=4, help="loader I/O threads (default 4, as OffloadConfig)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and JSON line to this file")
    args = ap.parse_args()
    try:
        latencies = [float(x) for x in args.emulate_read_ms.split(",")]
    except ValueError:
        ap.error(f"--emulate-read-ms {args.emulate_read_ms!r}; expected a comma list of numbers")
    prompts = [p.strip() for p in PROMPTS_FILE.read_text().splitlines() if p.strip()][: args.prompts]
    load0 = os.getloadavg()
    rng = random.Random(0)
    rows: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = convert(embedded_pair().target, Path(tmp) / "store")
        for budget in args.budgets.split(","):
            for ms in latencies:
                for r in range(args.repeats):
                    for i, prompt in enumerate(prompts):
                        order = list(VARIANTS)
                        rng.shuffle(order)
                        for v in order:
                            res = run_once(store, budget, ms, v, prompt, args.tokens, args.threads)
                            rows.setdefault((budget, ms, v), []).append(((r, i), res))
                print(f"... {budget} +{ms:g} ms done", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    lines = [f"embedded target (packed, O_DIRECT), greedy, {args.tokens} tokens x {len(prompts)} prompts x "
             f"{args.repeats} passes, each run from an empty cache, {args.threads} I/O threads; route-ahead off/on "
             f"interleaved; vs off: median [min-max] of per-prompt, per-pass tok/s ratios; counts per decoded token; "
             f"load average {load0[0]:.1f} before, {load1[0]:.1f} after",
             f"{'budget':6} {'reads':18} {'ahead':5} {'tok/s':>6}  {'vs off [min-max]':22} {'verdict':16} "
             f"{'CPU ms/tok':>10} {'wait ms/tok':>11} {'demand reads':>12} {'prefetched':>10} {'used':>6} "
             f"{'syncs/tok':>9} {'routed':>6}"]
    out = {}
    for budget, ms, v in [(b, ms, v) for b in args.budgets.split(",") for ms in latencies for v in VARIANTS]:
        runs = rows[(budget, ms, v)]
        off = dict(rows[(budget, ms, "off")])
        ratios = [res["tokens_per_s"] / off[key]["tokens_per_s"] for key, res in runs]
        med = lambda k: statistics.median(res[k] for _, res in runs)  # noqa: E731
        mean = lambda k: statistics.mean(res[k] for _, res in runs)  # noqa: E731
        verdict = "-" if v == "off" else "faster" if min(ratios) > 1 else "slower" if max(ratios) < 1 else \
            "within the noise"
        label = "real" if not ms else f"EMULATED +{ms:g} ms/read"
        rec = {"tokens_per_s": med("tokens_per_s"), "vs_off": statistics.median(ratios), "vs_off_min": min(ratios),
               "vs_off_max": max(ratios), "verdict": verdict, "cpu_ms_per_token": med("cpu_ms"),
               "wait_ms_per_token": mean("wait_ms"), "demand_reads_per_token": mean("demand_reads"),
               "prefetched_per_token": mean("prefetched"), "used_per_token": mean("used"),
               "syncs_per_token": mean("syncs"), "routed_share": mean("routed")}
        out[f"{budget} +{ms:g}ms {v}"] = rec
        lines.append(f"{budget:6} {label:18} {v:5} {rec['tokens_per_s']:6.1f}  {rec['vs_off']:4.2f} "
                     f"[{rec['vs_off_min']:.2f}-{rec['vs_off_max']:.2f}]{'':7} {verdict:16} "
                     f"{rec['cpu_ms_per_token']:10.2f} {rec['wait_ms_per_token']:11.2f} "
                     f"{rec['demand_reads_per_token']:12.2f} {rec['prefetched_per_token']:10.2f} "
                     f"{rec['used_per_token']:6.2f} {rec['syncs_per_token']:9.2f} {rec['routed_share']:6.0%}")
    lines.append(json.dumps({"bench": "route_ahead", "tokens": args.tokens, "prompts": len(prompts),
                             "repeats": args.repeats, "threads": args.threads,
                             "load_average": [list(load0), list(load1)], "results": out}))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
