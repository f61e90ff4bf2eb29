"""Several streams at once: batched decoding against the one-at-a-time queue, on the embedded target.

Physics: a paged decode step pays per token for work that does not grow with the number of tokens in
the forward: the host's Python and MLX graph building, one host sync per MoE layer below a full budget,
and the reads of absent experts. Decoding B streams together runs one forward of B tokens per step; each
MoE layer routes the B tokens, looks up the union of their experts once and reads each absent expert of
the union once. B streams one at a time pay all of it B times. The union is smaller than the sum when
streams share experts (how much depends on the model's routing: the embedded target has 64 experts,
top-4, 8 MoE layers).

Method: for each budget (--budgets) and number of streams B (--streams), the same B prompts (calibration
text, different lengths) are generated two ways, --max-tokens greedy tokens each (no end-of-sequence stop,
so every stream emits the same count): "queue", one stream after another through specmoe's plain decoding
(runtime.decode.generate_tokens, its default path), and "batch", all B inserted into one BatchDecoder
(runtime/decode/batch.py) at once. The expert cache is emptied before each run. --repeats repeats,
the two ways interleaved (their order alternates); medians with (min-max) spreads; the batch/queue ratio
is taken per repeat, also on CPU time (tokens per second of this process's CPU time, loader threads included:
on a machine other work also loads, wall-clock ratios carry that load's swings; CPU ratios much less).
Reported: aggregate tok/s (all streams' tokens over the wall time from the first
call to the last token, prefill included), per-stream decode tok/s (a stream's tokens after its first
over the time between its first and last token; median over streams) and the per-stream latency against
the single-stream queue (B = 1), experts read per token, and the batch's unique expert lookups per step
against the sum over its sequences. Batch tokens are checked equal to stock mlx-lm's BatchGenerator on
the resident model (greedy, same prompts). Prints a table and ends with one JSON line
(bench/run_all.sh writes it to bench/results/ with the date and load average).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.checkpoints.embedded import embedded_pair  # noqa: E402
from runtime.decode import BatchDecoder, OffloadConfig, OffloadedModel, generate_tokens  # noqa: E402


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode((files("runtime") / "data" / "calibration.txt").read_text())
    return [ids[131 * i: 131 * i + 12 + 5 * i] for i in range(n)]  # 12, 17, 22, ... tokens


def run_queue(om, prompts, n: int) -> dict:
    t0, cpu0 = time.perf_counter(), time.process_time()
    c0 = om.counters()["misses"]
    streams, tokens = [], []
    for p in prompts:
        times = []
        toks, _ = generate_tokens(om.model, p, max_tokens=n, om=om, on_token=lambda _t, times=times: times.append(time.perf_counter()))
        streams.append(times)
        tokens.append(toks)
    return _summary(t0, cpu0, streams, tokens, om.counters()["misses"] - c0)


def run_batch(om, prompts, n: int) -> dict:
    t0, cpu0 = time.perf_counter(), time.process_time()
    c0 = om.counters()["misses"]
    with BatchDecoder(om, max_tokens=n) as dec:
        uids = dec.insert(prompts, [n] * len(prompts))
        times = {u: [] for u in uids}
        tokens = {u: [] for u in uids}
        while responses := dec.next():
            now = time.perf_counter()
            for r in responses:
                times[r.uid].append(now)
                tokens[r.uid].append(r.token)
    out = _summary(t0, cpu0, [times[u] for u in uids], [tokens[u] for u in uids], om.counters()["misses"] - c0)
    out["unique_experts_per_step"] = dec.totals.unique_experts / max(1, dec.totals.steps)
    out["summed_experts_per_step"] = dec.totals.summed_experts / max(1, dec.totals.steps)
    out["decode_reads_per_step"] = dec.totals.reads / max(1, dec.totals.steps)
    return out


def run_steps(om, prompts, n: int, on_ids: bool) -> dict:
    """Decode steps per second of one batch once every stream has joined (the first step, which prefills, untimed),
    on a warm cache: its layers on their ids (on_ids) or each layer's routing read back (the per-layer path)."""
    with BatchDecoder(om, max_tokens=n, on_ids=on_ids) as dec:
        uids = dec.insert(prompts, [n] * len(prompts))
        tokens = {u: [] for u in uids}
        while dec.n_active < len(prompts):
            for r in dec.next():
                tokens[r.uid].append(r.token)
        steps0, syncs0 = dec.totals.steps, dec.totals.host_syncs
        t0, cpu0, calls = time.perf_counter(), time.process_time(), 0
        while responses := dec.next():
            calls += 1
            for r in responses:
                tokens[r.uid].append(r.token)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = dec.totals.steps - steps0  # after close: every step booked (a step on ids is booked once evaluated)
    return {"steps_per_s": calls / wall, "cpu_steps_per_s": calls / cpu, "steps": steps,
            "host_syncs_per_step": (dec.totals.host_syncs - syncs0) / max(1, steps), "tokens": [tokens[u] for u in uids]}


def compare_sync(path: Path, b: int, n: int, repeats: int) -> None:
    """--on-ids: B streams at 100%, the batch step on the routed ids (one sync) against per-layer syncs, interleaved."""
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        prompts = prompts_for(om.tokenizer, b)
        reference = stock_batch(path, prompts, n)
        runs, equal = {True: [], False: []}, True
        run_steps(om, prompts, 4, True)  # warm: every expert read, in order
        for r in range(repeats):
            for on_ids in ((True, False) if r % 2 == 0 else (False, True)):
                run = run_steps(om, prompts, n, on_ids)
                equal &= run.pop("tokens") == reference
                runs[on_ids].append(run)
    finally:
        om.close()
    ratio = [a["steps_per_s"] / s["steps_per_s"] for a, s in zip(runs[True], runs[False])]
    cpu_ratio = [a["cpu_steps_per_s"] / s["cpu_steps_per_s"] for a, s in zip(runs[True], runs[False])]
    lines = [f"embedded target at 100%, {b} streams x {n} greedy tokens, {repeats} interleaved repeats, median (min-max); "
             f"decode steps after every stream joined",
             f"{'path':<26}{'steps/s':>20}{'steps/s CPU time':>22}{'host syncs/step':>17}"]
    for on_ids, name in ((True, "on ids (one sync)"), (False, "per-layer syncs")):
        rs = runs[on_ids]
        lines.append(f"{name:<26}{med([x['steps_per_s'] for x in rs]):>20}{med([x['cpu_steps_per_s'] for x in rs]):>22}"
                     f"{statistics.median(x['host_syncs_per_step'] for x in rs):>17.2f}")
    lines.append(f"on ids / per-layer: wall {med2(ratio)}, CPU time {med2(cpu_ratio)} (paired per repeat)")
    lines.append(f"tokens equal to stock mlx-lm's BatchGenerator on the resident model, every run: {equal}")
    print("\n".join(lines))
    print(json.dumps({"bench": "batch_on_ids", "model": "embedded target", "streams": b, "max_tokens": n,
                      "repeats": repeats, "equal_stock_batch": equal, "ratio": ratio, "cpu_ratio": cpu_ratio,
                      "on_ids": runs[True], "per_layer": runs[False]}))


def _summary(t0: float, cpu0: float, streams: list[list[float]], tokens: list[list[int]], reads: int) -> dict:
    cpu = time.process_time() - cpu0
    end = max(s[-1] for s in streams)
    n_tokens = sum(len(s) for s in streams)
    per_stream = [(len(s) - 1) / (s[-1] - s[0]) for s in streams if len(s) > 1 and s[-1] > s[0]]
    return {"aggregate_tps": n_tokens / (end - t0), "cpu_tps": n_tokens / cpu, "stream_tps": statistics.median(per_stream),
            "reads_per_token": reads / n_tokens, "tokens": tokens}


def stock_batch(path: Path, prompts, n: int) -> list[list[int]]:
    model, _ = load(str(path))
    gen = BatchGenerator(model, max_tokens=n)
    uids = gen.insert(prompts, [n] * len(prompts))
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def med(xs) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def med2(xs) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="100%,50%,25%", help="comma-separated expert-cache budgets")
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated numbers of concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of queue and batch")
    ap.add_argument("--on-ids", action="store_true",
                    help="instead: at 100%%, the first of --streams batched with each step on the routed ids against "
                         "per-layer syncs (decode steps/s)")
    args = ap.parse_args()
    if args.on_ids:
        compare_sync(embedded_pair().target, int(args.streams.split(",")[0]), args.max_tokens, args.repeats)
        return
    budgets = args.budgets.split(",")
    counts = [int(s) for s in args.streams.split(",")]
    path = embedded_pair().target
    rows, equal = [], True
    for budget in budgets:
        om = OffloadedModel.load(path, OffloadConfig(budget=budget))
        try:
            all_prompts = prompts_for(om.tokenizer, max(counts))
            for b in counts:
                prompts = all_prompts[:b]
                reference = stock_batch(path, prompts, args.max_tokens)
                runs = {"queue": [], "batch": []}
                for r in range(args.repeats):
                    for way in (("queue", "batch") if r % 2 == 0 else ("batch", "queue")):
                        om.empty_cache()
                        run = (run_queue if way == "queue" else run_batch)(om, prompts, args.max_tokens)
                        runs[way].append(run)
                        if way == "batch":
                            equal &= run["tokens"] == reference
                rows.append({"budget": budget, "streams": b, **{w: [dict(x, tokens=None) for x in v] for w, v in runs.items()}})
        finally:
            om.close()
    single = {row["budget"]: [x["stream_tps"] for x in row["queue"]] for row in rows if row["streams"] == 1}
    lines = [f"embedded target (qwen3_moe, 8 MoE layers x 64 experts, top-4), {args.max_tokens} greedy tokens per stream, "
             f"{args.repeats} interleaved repeats, median (min-max)",
             f"{'budget':<7}{'B':>3}{'queue agg tok/s':>20}{'batch agg tok/s':>21}{'batch/queue':>19}{'batch/queue CPU':>19}"
             f"{'stream tok/s batch':>21}{'latency vs 1':>18}{'reads/tok q':>12}{'reads/tok b':>12}{'unique/summed per step':>24}"]
    for row in rows:
        q, bt = row["queue"], row["batch"]
        ratios = [b["aggregate_tps"] / x["aggregate_tps"] for b, x in zip(bt, q)]
        one = statistics.median(single.get(row["budget"], [float("nan")]))
        latency = [one / b["stream_tps"] for b in bt]  # per-token time of a batched stream / of a lone stream
        cpu_ratios = [b["cpu_tps"] / x["cpu_tps"] for b, x in zip(bt, q)]
        row["ratio"], row["cpu_ratio"] = ratios, cpu_ratios
        row["latency_vs_single"] = latency
        unique = statistics.median(b["unique_experts_per_step"] for b in bt)
        summed = statistics.median(b["summed_experts_per_step"] for b in bt)
        lines.append(f"{row['budget']:<7}{row['streams']:>3}{med([x['aggregate_tps'] for x in q]):>20}"
                     f"{med([b['aggregate_tps'] for b in bt]):>21}{med2(ratios):>19}{med2(cpu_ratios):>19}"
                     f"{med([b['stream_tps'] for b in bt]):>21}{med2(latency):>18}"
                     f"{statistics.median(x['reads_per_token'] for x in q):>12.2f}"
                     f"{statistics.median(b['reads_per_token'] for b in bt):>12.2f}"
                     f"{f'{unique:.1f} / {summed:.1f}':>24}")
    lines.append(f"batch tokens equal to stock mlx-lm's BatchGenerator on the resident model (greedy), every run: {equal}")
    table = "\n".join(lines)
    print(table)
    record = {"bench": "batch", "model": "embedded target", "max_tokens": args.max_tokens, "repeats": args.repeats,
              "equal_stock_batch": equal, "rows": rows}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
