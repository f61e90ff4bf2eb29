"""Full-scale runs under a memory cap that counts page cache, judged against the compute + I/O limit.

    python -m bench.capped_run --model DIR --caps 10.7GB,8GB --budgets 4GB,auto -n 12 [--out FILE]

The physics: with every expert resident, a decode step costs its compute, C seconds per token
(measured outside the cap: the faster of specmoe at a 100% budget and stock mlx-lm; the same for
prefill). Under a cap, a step also reads the experts it misses: B bytes per token from a disk of
bandwidth W (measured here: O_DIRECT random reads of the checkpoint). Nothing can beat
    decode limit  = C + B / W                      seconds per token (B: the run's own MB read per token)
    TTFT limit    = prefill compute + U / W        (U: the prompt's unique routed-expert bytes, read once)
so each capped row reports its tok/s as a share of 1 / decode limit, and its TTFT as a multiple of the
TTFT limit. Rows:
    stock resident       mlx-lm, no cap: the reference tokens (skipped when RAM cannot hold the model)
    specmoe 100%         no cap, memory governor off: C, and tokens vs stock (skipped as stock's is)
    specmoe B @ cap      each budget under each cap (cgroup v1, page cache counted, checkpoint evicted
                         from the page cache first; --io-mode direct by default)
    stock @ cap          (--stock-capped) mlx-lm under each cap: runs, thrashes or is killed
    specmoe B MODE       (--io-compare MODE) the first budget under the smallest cap, --io-repeats pairs of
                         runs in --io-mode and in MODE, alternating which goes first; a note gives each
                         mode's median tok/s [min-max] and their ratio
With --repeats N the resident specmoe 100% row and every capped specmoe row run N times, in rounds (round r:
100% resident, then each cap x budget), and a note per cap x budget gives the ratio to the limit paired by
round: each run's limit uses its own round's resident compute, so a load change that slows both cancels.
Peak memory is the cgroup's (process + charged page cache) and the command's peak RSS (VmHWM).

Output: a table, then one JSON line; --out writes both with a first line naming the command, the date
(UTC) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.fullscale_bandwidth import checkpoint_files, read_bandwidth
from bench.fullscale_cgroup import CappedResult, MemoryCgroup, available, drop_file_cache, run_uncapped
from bench.result_header import loadavg, write_result

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = "The history of the city begins"


@dataclass
class Row:
    run: str  # what ran: "stock resident", "specmoe 100%", "specmoe 4GB", "stock"
    cap_gb: float  # the cgroup cap (0: none)
    exit_code: int  # the command's exit code (-9: killed)
    oom_killed: bool  # the kernel's OOM killer fired in the cgroup
    tok_s: float = 0.0  # decode tokens per second
    limit_tok_s: float = 0.0  # 1 / (compute + bytes read per token / bandwidth)
    ratio: float = 0.0  # tok_s / limit_tok_s
    ttft_s: float = 0.0  # time to the first token (prefill)
    ttft_limit_s: float = 0.0  # prefill compute + unique expert bytes / bandwidth
    ttft_x: float = 0.0  # ttft_s / ttft_limit_s (1.0 = at the limit)
    cgroup_peak_gb: float = 0.0  # memory.max_usage_in_bytes (0: no cap)
    rss_peak_gb: float = 0.0  # the command's peak RSS
    hit_rate: float = 0.0  # decode hit rate
    mb_per_token: float = 0.0  # decode MB read per token
    syncs_per_token: float = 0.0  # decode host syncs per token
    tokens_equal: str = "n/a"  # vs stock resident: yes / no / n/a (no reference)
    wall_s: float = 0.0  # the command's wall time (load included)


def parse_gb(text: str) -> int:
    """Bytes of one --caps entry (a size, as --memory-limit takes it)."""
    from runtime.cache.memory_limit import parse_memory_limit

    try:
        value = parse_memory_limit(text)
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"--caps {text!r}: expected sizes like 10.7GB,8GB")
    return value


def decode_limit_s(compute_s: float, mb_per_token: float, bandwidth_bps: float) -> float:
    return compute_s + mb_per_token * 1e6 / bandwidth_bps


def ttft_limit_s(prefill_compute_s: float, unique_bytes: int, bandwidth_bps: float) -> float:
    return prefill_compute_s + unique_bytes / bandwidth_bps


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def specmoe_cmd(model: Path, prompt: str, n: int, budget: str, io_mode: str, json_path: Path,
                resident: bool = False) -> list[str]:
    """`specmoe generate` for one row. resident: the uncapped 100% row that measures compute. It runs only when the
    model fits with 1 GB to spare (as stock's resident row) and without the memory governor, which would otherwise
    give experts back on a machine the checkpoint nearly fills and measure reads instead of compute."""
    return [sys.executable, "-m", "runtime.cli.app", "generate", "-m", str(model), "-p", prompt, "-n", str(n),
            "--budget", budget, "--raw-prompt", "--io-mode", io_mode, "--json", str(json_path)] + \
        (["--no-memory-governor"] if resident else [])


def stock_cmd(model: Path, prompt: str, n: int, json_path: Path) -> list[str]:
    return [sys.executable, "-m", "bench.fullscale_stock", "--model", str(model), "--prompt", prompt,
            "-n", str(n), "--json", str(json_path)]


def _run(cmd: list[str], cap: int | None, model: Path, log) -> CappedResult:
    drop_file_cache(checkpoint_files(model))  # every run starts cold
    if cap is None:
        return run_uncapped(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    with MemoryCgroup(cap) as cg:
        return cg.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())


def _stats(result: dict) -> dict:
    """The generation stats of a result: specmoe generate --json's "detail" (its GenerationStats), else the
    stock runner's own fields."""
    return result.get("detail") or result.get("stats") or result


def _row(name: str, cap: int | None, res: CappedResult, result: dict | None, ref: list | None) -> Row:
    row = Row(name, round((cap or 0) / 1e9, 2), res.exit_code, res.oom_killed, cgroup_peak_gb=res.cgroup_peak_bytes / 1e9,
              rss_peak_gb=res.rss_peak_bytes / 1e9, wall_s=res.wall_s)
    if result is None:
        return row
    stats = _stats(result)
    row.tok_s, row.ttft_s = stats["tokens_per_s"], stats["prefill_s"]
    row.hit_rate = stats.get("hit_rate", 1.0)
    row.mb_per_token = stats.get("mb_read_per_token", 0.0)
    row.syncs_per_token = stats.get("host_syncs_per_token", 0.0)
    if ref is not None:
        row.tokens_equal = "yes" if result["tokens"] == ref else "no"
    return row


def measure(model: Path, *, caps: list[int], budgets: list[str], n: int, prompt: str, io_mode: str, stock: bool,
            stock_capped: bool, bandwidth_bps: float | None, log, io_compare: str | None = None,
            io_repeats: int = 2, repeats: int = 1) -> dict:
    """All rows of one checkpoint (see the module docstring)."""
    import psutil

    size = sum(p.stat().st_size for p in checkpoint_files(model))
    if bandwidth_bps is None:
        bw = read_bandwidth(checkpoint_files(model), total_bytes=min(1 << 30, size // 2), chunk_bytes=1 << 20)
        bandwidth_bps, bw_line = bw.bytes_per_s, bw.line()
    else:
        bw_line = f"given: {bandwidth_bps / 1e9:.2f} GB/s"
    tmp = Path(tempfile.mkdtemp(prefix="capped-run-"))
    entries, results, notes = [], {}, [f"bandwidth: {bw_line}"]  # entries: (row, its JSON result)

    def fits() -> bool:
        return psutil.virtual_memory().available > size + (1 << 30)  # the model resident, 1 GB to spare

    def go(name, cmd, json_path, cap):
        res = _run(cmd, cap, model, log)
        result = json.loads(json_path.read_text()) if res.exit_code == 0 and json_path.exists() else None
        ref = results.get("stock resident", {}).get("tokens") if name != "stock resident" else None
        entries.append((_row(name, cap, res, result, ref), result or {}))
        results[name + (f" @ {cap / 1e9:.1f}GB" if cap else "")] = result or {}
        return result

    if stock and fits():
        go("stock resident", stock_cmd(model, prompt, n, tmp / "stock.json"), tmp / "stock.json", None)
    elif stock:
        notes.append(f"stock resident: not runnable here ({psutil.virtual_memory().available / 1e9:.1f} GB available, "
                     f"the model is {size / 1e9:.1f} GB)")
    rounds = []  # per round: (resident specmoe 100% result, [(capped row, its result)])
    for r in range(repeats):
        full = tmp / f"full{r}.json"  # this round's resident compute
        resident = go("specmoe 100%", specmoe_cmd(model, prompt, n, "100%", io_mode, full, resident=True), full,
                      None) if fits() else None
        capped = []
        for cap in caps:
            for budget in budgets:
                j = tmp / f"capped-{cap}-{budget.replace('%', 'pct')}-{r}.json"
                go(f"specmoe {budget}", specmoe_cmd(model, prompt, n, budget, io_mode, j), j, cap)
                capped.append(entries[-1])
            if stock_capped and r == 0:
                go("stock", stock_cmd(model, prompt, n, tmp / f"stock-{cap}.json"), tmp / f"stock-{cap}.json", cap)
        rounds.append((resident, capped))
    ref_stock = results.get("stock resident") or {}
    # The fastest resident measurement bounds the compute from above: the limit is the tightest one known (over
    # every round's specmoe 100% run and stock's).
    ours = [_stats(r) for r, _ in rounds if r] or ([_stats(resident)] if resident else [])
    fastest = max(ours, key=lambda v: v.get("tokens_per_s") or 0.0, default=None)
    measured = {name: v for name, v in (("specmoe 100%", fastest), ("stock", _stats(ref_stock) if ref_stock else None))
                if v}
    per_token = {k: 1 / v["tokens_per_s"] for k, v in measured.items() if v.get("tokens_per_s")}
    prefill = {k: min(x["prefill_s"] for x in ours if x.get("prefill_s")) if k == "specmoe 100%" else v["prefill_s"]
               for k, v in measured.items() if v.get("prefill_s")}
    compute_s = min(per_token.values(), default=0.0)
    prefill_s = min(prefill.values(), default=0.0)
    notes.append("compute per token (resident, no cap): " + ", ".join(f"{k} {v:.3f} s" for k, v in per_token.items())
                 + "; prefill: " + ", ".join(f"{k} {v:.2f} s" for k, v in prefill.items()) + "; the limits use the smaller")
    if io_compare and caps and budgets:  # interleaved pairs: the same budget and cap, each I/O mode
        cap, budget = min(caps), budgets[0]
        for i in range(io_repeats):
            for mode in ((io_mode, io_compare) if i % 2 == 0 else (io_compare, io_mode)):
                j = tmp / f"io-{mode}-{i}.json"
                go(f"specmoe {budget} {mode}", specmoe_cmd(model, prompt, n, budget, mode, j), j, cap)
        notes.append(io_note(entries, budget, (io_mode, io_compare)))
    for row, result in entries:
        if not result or not compute_s:
            continue
        row.limit_tok_s = 1 / decode_limit_s(compute_s, row.mb_per_token, bandwidth_bps)
        row.ratio = row.tok_s / row.limit_tok_s if row.limit_tok_s else 0.0
        unique = (_stats(result).get("prefill") or {}).get("unique_bytes", 0)
        row.ttft_limit_s = ttft_limit_s(prefill_s, unique, bandwidth_bps)
        row.ttft_x = row.ttft_s / row.ttft_limit_s if row.ttft_limit_s else 0.0
    if repeats > 1:
        notes += paired_notes(rounds, bandwidth_bps)
    return {"model": str(model), "checkpoint_gb": size / 1e9, "bandwidth_gbps": bandwidth_bps / 1e9,
            "compute_s_per_token": compute_s, "prefill_compute_s": prefill_s, "notes": notes,
            "rows": [asdict(r) for r, _ in entries], "tokens": {k: v.get("tokens") for k, v in results.items()}}


def paired_notes(rounds: list, bandwidth_bps: float) -> list[str]:
    """Per cap x budget: tok/s and the ratio to the limit over the rounds, each run's limit from its own round's
    resident compute, as median (min-max). A round whose resident run was not resident (it missed: the memory
    governor shrank the cache on a machine the checkpoint nearly fills) measured no compute and is left out."""
    import statistics

    by_run: dict = {}
    paged = sum(1 for resident, _ in rounds if resident and _stats(resident).get("hit_rate", 1.0) < 1.0)
    for resident, capped in rounds:
        stats = _stats(resident) if resident else {}
        rate = stats.get("tokens_per_s") if stats.get("hit_rate", 1.0) >= 1.0 else None
        for row, result in capped:
            if not result or not rate:
                continue
            limit = 1 / decode_limit_s(1 / rate, row.mb_per_token, bandwidth_bps)
            by_run.setdefault((row.run, row.cap_gb), []).append((row.tok_s, row.tok_s / limit))
    lines = []
    for (run, cap), v in by_run.items():
        rates, ratios = [t for t, _ in v], [x for _, x in v]
        lines.append(f"paired by round ({run} @ {cap:.1f} GB, {len(v)} rounds): {statistics.median(rates):.3f} tok/s "
                     f"[{min(rates):.3f}-{max(rates):.3f}], ratio to the limit {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
    if paged:
        lines.append(f"paired by round: {paged} round(s) left out, their resident run paged (hit rate below 100%)")
    return lines


def io_note(entries, budget: str, modes: tuple[str, str]) -> str:
    """One line: each I/O mode's median decode tok/s [min-max] over its paired runs, and their ratio."""
    import statistics

    rates = {m: [r.tok_s for r, res in entries if r.run == f"specmoe {budget} {m}" and res] for m in modes}
    if not all(rates.values()):
        return f"io pairs ({budget}): a run failed, no comparison"
    med = {m: statistics.median(v) for m, v in rates.items()}
    parts = [f"{m} {med[m]:.3f} tok/s [{min(v):.3f}-{max(v):.3f}] over {len(v)}" for m, v in rates.items()]
    return f"io pairs ({budget}, interleaved): " + "; ".join(parts) + f"; {modes[1]}/{modes[0]} {med[modes[1]] / med[modes[0]]:.2f}x"


def table(summary: dict) -> str:
    head = (f"{'run':<22}{'cap GB':>7}{'exit':>6}{'tok/s':>7}{'limit':>7}{'ratio':>7}{'TTFT s':>8}{'x lim':>7}"
            f"{'cg GB':>7}{'RSS GB':>7}{'hit':>6}{'MB/tok':>8}{'sync/t':>7}{'equal':>6}")
    lines = [head]
    for r in summary["rows"]:
        lines.append(f"{r['run']:<22}{r['cap_gb']:>7.1f}{r['exit_code']:>6}{r['tok_s']:>7.3f}{r['limit_tok_s']:>7.3f}"
                     f"{r['ratio']:>7.2f}{r['ttft_s']:>8.1f}{r['ttft_x']:>7.2f}{r['cgroup_peak_gb']:>7.2f}"
                     f"{r['rss_peak_gb']:>7.2f}{r['hit_rate']:>6.0%}{r['mb_per_token']:>8.1f}{r['syncs_per_token']:>7.1f}"
                     f"{r['tokens_equal']:>6}" + ("  OOM-killed" if r["oom_killed"] else ""))
    return "\n".join(lines + [f"# {n}" for n in summary["notes"]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (bench/fullscale_checkpoint.py writes one)")
    ap.add_argument("--caps", default="10.7GB,8GB", help="memory caps, comma-separated (a 16 GB Mac's GPU working set: 10.7GB)")
    ap.add_argument("--budgets", default="4GB,auto", help="specmoe --budget values run under each cap")
    ap.add_argument("-n", "--max-tokens", type=int, default=12, help="greedy tokens per run")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="raw prompt")
    ap.add_argument("--io-mode", default="direct", help="specmoe --io-mode under the caps: direct or buffered")
    ap.add_argument("--io-compare", default=None, choices=["buffered", "direct"],
                    help="also run the first budget under the smallest cap in this I/O mode and --io-mode, interleaved")
    ap.add_argument("--io-repeats", type=int, default=2, help="pairs of --io-compare runs")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the resident 100%% row and every capped specmoe row; each capped run's ratio is "
                         "paired with its own round's resident compute (a note per cap x budget)")
    ap.add_argument("--no-stock", dest="stock", action="store_false", help="skip the stock resident reference")
    ap.add_argument("--stock-capped", action="store_true", help="also run stock mlx-lm under each cap")
    ap.add_argument("--bandwidth-gbps", type=float, default=None, help="use this disk bandwidth instead of measuring it")
    ap.add_argument("--out", default=None, help="also write the table and JSON line here (with date and load average)")
    ap.add_argument("--log", default=None, help="the commands' output (default: discarded)")
    ap.add_argument("--note", default=None, help="a line for --out's header (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    try:
        caps = [parse_gb(c) for c in args.caps.split(",") if c]
        model = Path(args.model)
        if not (model / "config.json").exists():
            raise ValueError(f"--model {model}: no config.json; expected a checkpoint directory")
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats}: expected >= 1")
        why = available() if caps else None
        if why:
            raise ValueError(f"--caps need a memory cgroup: {why}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load0, t0 = loadavg(), time.time()
    with open(args.log or os.devnull, "a") as log:
        summary = measure(model, caps=caps, budgets=[b for b in args.budgets.split(",") if b], n=args.max_tokens,
                          prompt=args.prompt, io_mode=args.io_mode, stock=args.stock, stock_capped=args.stock_capped,
                          bandwidth_bps=args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else None, log=log,
                          io_compare=args.io_compare if args.io_compare != args.io_mode else None, io_repeats=args.io_repeats,
                          repeats=args.repeats)
    summary["load_average"] = {"before": load0, "after": loadavg()}
    text = table(summary) + "\n" + json.dumps(summary)
    print(text)
    if args.out:
        write_result(args.out, "capped_run", argv, t0, load0, text, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
