"""Batched decoding of a full-size checkpoint under a memory cap: 4 streams together against one at a time.

    python -m bench.bench_batch_fullscale --model /tmp/fullscale/qwen3-30b-a3b --cap 8GB --budget 4GB \
        --streams 4 -n 6 --repeats 2 [--deadline-s 900] [--out FILE]

Physics: under a cap that counts page cache (bench/fullscale_cgroup.py) every expert a step misses is a disk
read of a few MB; a decode step is bound by those reads. B streams one at a time read, per token, the experts
their own token misses; B streams batched read, per step, the misses of the union of their B tokens' experts,
which is smaller than the sum when the tokens share experts. The batch also prefills its B prompts together
(expert-major: each unique expert of all the prompts read once) where the queue prefills each prompt alone.

Method: each run is a fresh process in a fresh cgroup (the cap), the checkpoint evicted from the page cache
first, --io-mode direct, --memory-limit auto (the cap, as `specmoe` and runtime.load default to): "queue" generates the B prompts one after another through plain decoding
(runtime.decode.generate_tokens); "batch" inserts all B into one BatchDecoder (runtime/decode/batch.py). The
two ways alternate which runs first, --repeats times. Reported per run: aggregate tok/s (every stream's tokens
over the wall time from the first prompt to the last token, prefill included; the model's load excluded), decode
tok/s (tokens after each stream's first, over the time its decoding spanned), per-stream latency (a stream's
seconds per token after its first, median over streams), per step of the batch its unique expert lookups against
their sum over the sequences and the experts it read, MB read (all and decode only), the cgroup's peak memory
(process plus charged page cache) and the load average. --deadline-s: a run is not started when the previous run
of its kind says it would end past the deadline, and a run still going then is killed (the file says which).

Tokens: batch against queue (on this CPU backend batched and single-sequence greedy tokens agree for the stock
families, bench/results/batch_stock_drift.txt); the lossless check against stock mlx-lm's BatchGenerator needs
the model resident and is the tests' (tests/test_batch_generate.py). Prints a table and one JSON line; --out
writes both under a header line with the command, the date and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.result_header import loadavg, write_result  # noqa: E402


def prompts_for(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length`, `length` + 1, ... tokens from different places of the calibration text."""
    ids = tokenizer.encode((files("runtime") / "data" / "calibration.txt").read_text())
    return [ids[131 * i: 131 * i + length + i] for i in range(n)]


# -- the child: one way, one process, inside the cgroup -------------------------------------------------------------
def child(args) -> None:
    from runtime.decode import BatchDecoder, OffloadConfig, OffloadedModel, generate_tokens

    t_load = time.perf_counter()
    om = OffloadedModel.load(args.model, OffloadConfig(budget=args.budget, io_mode=args.io_mode, memory_limit="auto"))
    load_s = time.perf_counter() - t_load
    try:
        prompts = prompts_for(om.tokenizer, args.streams, args.prompt_tokens)
        bytes0 = om.loader.stats.bytes_read
        t0 = time.perf_counter()
        times: list[list[float]] = []
        tokens: list[list[int]] = []
        extra = {}
        if args.child == "queue":
            decode_bytes = 0
            for p in prompts:
                stamps, marks = [], []  # each token's time and the loader's bytes then

                def on_token(_t, stamps=stamps, marks=marks):
                    stamps.append(time.perf_counter())
                    marks.append(om.loader.stats.bytes_read)

                toks, _ = generate_tokens(om.model, p, max_tokens=args.max_tokens, om=om, on_token=on_token)
                times.append(stamps)
                tokens.append([int(t) for t in toks])
                decode_bytes += marks[-1] - marks[0]  # read between its first token and its last
        else:
            with BatchDecoder(om, max_tokens=args.max_tokens) as dec:
                uids = dec.insert(prompts, [args.max_tokens] * len(prompts))
                stamps = {u: [] for u in uids}
                out = {u: [] for u in uids}
                while responses := dec.next():
                    now = time.perf_counter()
                    for r in responses:
                        stamps[r.uid].append(now)
                        out[r.uid].append(int(r.token))
            times, tokens = [stamps[u] for u in uids], [out[u] for u in uids]
            t = dec.totals
            decode_bytes = t.bytes_read
            extra = {"steps": t.steps, "unique_experts_per_step": t.unique_experts / max(1, t.steps),
                     "summed_experts_per_step": t.summed_experts / max(1, t.steps),
                     "reads_per_step": t.reads / max(1, t.steps), "prefill_reads": t.prefill_reads}
        end = max(s[-1] for s in times)
        n = sum(len(s) for s in times)
        n_decode = sum(len(s) - 1 for s in times)
        decode_span = (end - min(s[0] for s in times)) if args.child == "batch" else sum(s[-1] - s[0] for s in times)
        latency = [(s[-1] - s[0]) / (len(s) - 1) for s in times if len(s) > 1]
        result = {"way": args.child, "load_s": load_s, "wall_s": end - t0, "tokens_total": n,
                  "aggregate_tps": n / (end - t0), "decode_tps": n_decode / decode_span if decode_span > 0 else 0.0,
                  "stream_latency_s": statistics.median(latency) if latency else 0.0,
                  "mb_read": (om.loader.stats.bytes_read - bytes0) / 1e6, "decode_mb_read": decode_bytes / 1e6,
                  "misses_total": om.counters()["misses"], "tokens": tokens, **extra}
        gov = om.context_governor  # --memory-limit auto under the cap: slots given way to the KV, if any
        if gov is not None:
            result["governor"] = {"updates": gov.stats.n_updates, "shrinks": gov.stats.n_shrinks,
                                  "usable_slots_at_end": gov.stats.usable, "kv_bytes": gov.stats.kv_bytes,
                                  "planned_slots": gov.max_slots}
    finally:
        om.close()
    Path(args.json).write_text(json.dumps(result))


# -- the parent: capped runs, interleaved ----------------------------------------------------------------------------
def capped(args, way: str, cap: int, json_path: Path, log, timeout_s: float | None = None) -> dict:
    from bench.capped_run import _env
    from bench.fullscale_bandwidth import checkpoint_files
    from bench.fullscale_cgroup import MemoryCgroup, drop_file_cache

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", way, "--model", str(args.model), "--budget",
           args.budget, "--streams", str(args.streams), "-n", str(args.max_tokens), "--prompt-tokens",
           str(args.prompt_tokens), "--io-mode", args.io_mode, "--json", str(json_path)]
    drop_file_cache(checkpoint_files(args.model))
    load0 = loadavg()
    with MemoryCgroup(cap) as cg:
        res = cg.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout_s=timeout_s)
    out = {"way": way, "exit_code": res.exit_code, "oom_killed": res.oom_killed, "process_wall_s": res.wall_s,
           "cgroup_peak_gb": res.cgroup_peak_bytes / 1e9, "rss_peak_gb": res.rss_peak_bytes / 1e9,
           "load_before": load0, "load_after": loadavg()}
    if res.exit_code == 0 and json_path.exists():
        out.update(json.loads(json_path.read_text()))
    return out


def med(xs, fmt="{:.3f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(xs), min(xs), max(xs))


def table(args, runs: list[dict], skipped: list[str]) -> tuple[str, dict]:
    ok = {w: [r for r in runs if r["way"] == w and r.get("aggregate_tps")] for w in ("queue", "batch")}
    pairs = list(zip(ok["queue"], ok["batch"]))
    ratio = [b["aggregate_tps"] / q["aggregate_tps"] for q, b in pairs]
    decode_ratio = [b["decode_tps"] / q["decode_tps"] for q, b in pairs if q["decode_tps"]]
    latency = [b["stream_latency_s"] / q["stream_latency_s"] for q, b in pairs if q["stream_latency_s"]]
    lines = [f"{args.model.name}: {args.streams} streams x {args.max_tokens} greedy tokens (prompts of "
             f"{args.prompt_tokens}-{args.prompt_tokens + args.streams - 1} tokens), budget {args.budget}, cap {args.cap} "
             f"(cgroup v1, page cache counted), --io-mode {args.io_mode}; each run a fresh process, checkpoint evicted first",
             f"{'run':<4}{'way':<7}{'exit':>5}{'agg tok/s':>10}{'decode tok/s':>13}{'s/token/stream':>15}{'MB read':>9}"
             f"{'decode MB':>10}{'uniq/summed/read per step':>27}{'cg peak GB':>11}{'load before -> after':>28}"]
    for i, r in enumerate(runs):
        per_step = (f"{r['unique_experts_per_step']:.0f} / {r['summed_experts_per_step']:.0f} / {r['reads_per_step']:.0f}"
                    if r.get("steps") else "-")
        lines.append(f"{i + 1:<4}{r['way']:<7}{r['exit_code']:>5}{r.get('aggregate_tps', 0):>10.3f}"
                     f"{r.get('decode_tps', 0):>13.3f}{r.get('stream_latency_s', 0):>15.2f}{r.get('mb_read', 0):>9.0f}"
                     f"{r.get('decode_mb_read', 0):>10.0f}{per_step:>27}{r['cgroup_peak_gb']:>11.2f}"
                     f"{r['load_before'].split()[0] + ' -> ' + r['load_after'].split()[0]:>28}")
    equal = all(b.get("tokens") == q.get("tokens") for q, b in pairs) if pairs else None
    lines.append(f"batch/queue aggregate tok/s {med(ratio, '{:.2f}')}, decode tok/s {med(decode_ratio, '{:.2f}')}, "
                 f"per-stream latency {med(latency, '{:.2f}')} (paired per repeat); batch tokens equal the queue's: {equal}")
    for s in skipped:
        lines.append(f"not run: {s}")
    summary = {"ratio": ratio, "decode_ratio": decode_ratio, "latency_ratio": latency, "tokens_equal_queue": equal,
               "skipped": skipped}
    return "\n".join(lines), summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory (bench/fullscale_checkpoint.py)")
    ap.add_argument("--cap", default="8GB", help="the memory cap (cgroup v1, page cache counted)")
    ap.add_argument("--budget", default="4GB", help="specmoe --budget of every run")
    ap.add_argument("--streams", type=int, default=4, help="prompts: one at a time (queue) or batched together")
    ap.add_argument("-n", "--max-tokens", type=int, default=6, help="greedy tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=5, help="the first prompt's length (each next one token longer)")
    ap.add_argument("--repeats", type=int, default=2, help="queue/batch pairs, alternating which runs first")
    ap.add_argument("--io-mode", default="direct", choices=["buffered", "direct"], help="specmoe --io-mode")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="do not start a run that the previous run of its kind says would end after this many seconds; "
                         "a run still going at the deadline is killed (reported with its exit code)")
    ap.add_argument("--out", default=None, help="also write the table and JSON line here")
    ap.add_argument("--log", default=None, help="the runs' output (default: discarded)")
    ap.add_argument("--note", default=None, help="a line for --out's header (e.g. what else ran on the machine)")
    ap.add_argument("--child", choices=["queue", "batch"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from bench.capped_run import parse_gb
    from bench.fullscale_cgroup import available

    try:
        cap = parse_gb(args.cap)
        if not (args.model / "config.json").exists():
            raise ValueError(f"--model {args.model}: no config.json; expected a checkpoint directory")
        if available():
            raise ValueError(f"--cap needs a memory cgroup: {available()}")
        if args.streams < 1 or args.max_tokens < 2 or args.repeats < 1:
            raise ValueError("--streams >= 1, -n >= 2 and --repeats >= 1 expected")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load0, t0 = loadavg(), time.time()
    tmp = Path(tempfile.mkdtemp(prefix="fullscale-batch-"))
    runs, skipped, last = [], [], {}
    with open(args.log or os.devnull, "a") as log:
        for i in range(args.repeats):
            for way in (("queue", "batch") if i % 2 == 0 else ("batch", "queue")):
                if args.deadline_s is not None and way in last and \
                        time.time() - t0 + last[way] > args.deadline_s:
                    skipped.append(f"repeat {i + 1} {way}: {time.time() - t0:.0f} s in, the last {way} run took "
                                   f"{last[way]:.0f} s: it would end past --deadline-s {args.deadline_s:.0f}")
                    continue
                left = None if args.deadline_s is None else max(1.0, args.deadline_s - (time.time() - t0))
                r = capped(args, way, cap, tmp / f"{way}-{i}.json", log, timeout_s=left)
                last[way] = r["process_wall_s"]
                runs.append(r)
                print(f"# {way} run {i + 1}: exit {r['exit_code']}, {r['process_wall_s']:.0f} s", file=sys.stderr)
    text, summary = table(args, runs, skipped)
    record = {"bench": "batch_fullscale", "model": str(args.model), "cap": args.cap, "budget": args.budget,
              "streams": args.streams, "max_tokens": args.max_tokens, "repeats": args.repeats, "summary": summary,
              "runs": runs, "load_average": {"before": load0, "after": loadavg()}}
    text += "\n" + json.dumps(record)
    print(text)
    if args.out:
        write_result(args.out, "bench_batch_fullscale", argv, t0, load0, text, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
