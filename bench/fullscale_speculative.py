"""A drafter against plain decoding at full depth, under a memory cap that counts page cache: by default one the
target never accepts; with --draft, any (e.g. bench/random_drafter.py --share-output, one it often accepts).

    python -m bench.fullscale_speculative --model /tmp/fullscale/qwen3-30b-a3b --cap 8GB --budget 4GB -n 12 \
        --pairs 3 [--draft DIR] [--read-mbps R] [--out FILE]

Physics: a random-weight drafter of another width (bench/random_drafter.py: Qwen3-0.6B's shape, hidden
1024, 28 layers, the target's tokenizer) proposes tokens the target never agrees with. Adaptive K starts
with a probe (the target's plain step, checked against the drafter's proposal), stays at 0 while probes
fail and re-probes after stretches that double; a K = 0 stretch decodes as plain decoding does. What it
may still cost against plain: the drafter's prefill, probes and forwards, and its memory. The goal:
at most 10% (ratio >= 0.90) at full depth, where each target token is seconds and reads hit the disk.

Each pair runs `specmoe generate` plain and with `--draft` (the CLI's defaults otherwise: the predictor a
pair of different widths resolves to, adaptive K), back to back in alternating order, each in a fresh
cgroup with the checkpoint evicted from the page cache first (bench/fullscale_cgroup.py). tok/s is
RunStats' decode rate for both (tokens after the first / time since the first, docs/json.md); the ratio
is the median of the per-pair speculative/plain ratios with their min-max. The decode rate leaves out the
first round: a speculative run's first token comes from its first round (after the drafter's prefill), a plain
run's from the prefill, so that round's cost lands in TTFT; the end-to-end ratio (plain's TTFT + decode time over
speculative's) counts it. Tokens must be equal in every
run. --read-mbps caps every run's reads from the checkpoint's disk (a cgroup blkio throttle,
bench/fullscale_cgroup.py): a slower disk than this one, so that reads, not this CPU's compute, set a token's
pace, as they do on a Mac whose GPU computes a token many times faster than this CPU. The table's "disk GB" is
what the kernel counted each run reading from that disk. Prints a table and one JSON line; --out writes both under a first line with the date and load.
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
from pathlib import Path

from bench.capped_run import DEFAULT_PROMPT, _env, parse_gb
from bench.result_header import loadavg, write_result
from bench.fullscale_bandwidth import checkpoint_files
from bench.fullscale_cgroup import MemoryCgroup, available, disk_of, drop_file_cache, throttle_available
from bench.random_drafter import write_random_drafter


def run(model: Path, draft: Path | None, args, cap: int, json_path: Path, log) -> dict:
    cmd = [sys.executable, "-m", "runtime.cli.app", "generate", "-m", str(model), "-p", args.prompt, "-n",
           str(args.max_tokens), "--budget", args.budget, "--raw-prompt", "--io-mode", args.io_mode, "--json", str(json_path)]
    if draft is not None:
        cmd += ["--draft", str(draft)] + (["--num-draft", str(args.num_draft)] if args.num_draft else [])
        cmd += ["--predictor", args.predictor] if args.predictor else []
    drop_file_cache(checkpoint_files(model))
    throttle = {} if args.read_mbps is None else {"read_bps": int(args.read_mbps * 1e6), "device": disk_of(model)}
    with MemoryCgroup(cap, **throttle) as cg:
        res = cg.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
        disk_bytes = cg.read_bytes()
    out = {"exit_code": res.exit_code, "oom_killed": res.oom_killed, "cgroup_peak_gb": res.cgroup_peak_bytes / 1e9,
           "rss_peak_gb": res.rss_peak_bytes / 1e9, "wall_s": res.wall_s}
    if throttle:
        out["disk_read_gb"] = disk_bytes / 1e9
    if res.exit_code != 0 or not json_path.exists():
        return out
    result = json.loads(json_path.read_text())
    s, d = result["stats"], result["detail"]
    out.update(tokens=result["tokens"], tok_s=s["tokens_per_s"], ttft_s=s["prefill"]["seconds"],
               e2e_s=s["prefill"]["seconds"] + s["decode"]["seconds"],
               hit_rate=s["hit_rate"], mb_per_token=s["mb_read_per_token"], syncs_per_token=s["host_syncs_per_token"],
               predictor=result.get("predictor"))
    if draft is not None:
        out.update({k: d.get(k) for k in ("acceptance", "n_rounds", "n_plain_rounds", "n_probes", "n_verifies",
                                          "draft_s", "verify_s", "rewind_s", "decode_s")})
    return out


def summarize(pairs: list[dict]) -> dict:
    ok = [p for p in pairs if p["plain"].get("tok_s") and p["spec"].get("tok_s")]
    ratios = [p["spec"]["tok_s"] / p["plain"]["tok_s"] for p in ok]
    ttft = [p["spec"]["ttft_s"] / p["plain"]["ttft_s"] for p in ok]
    e2e = [p["plain"]["e2e_s"] / p["spec"]["e2e_s"] for p in ok if p["plain"].get("e2e_s") and p["spec"].get("e2e_s")]
    tokens = {tuple(r[k].get("tokens") or ()) for r in pairs for k in ("plain", "spec")}
    return {"n_pairs": len(ok), "ratio": statistics.median(ratios) if ratios else 0.0,
            "ratio_min": min(ratios, default=0.0), "ratio_max": max(ratios, default=0.0), "ratios": ratios,
            "ttft_ratio": statistics.median(ttft) if ttft else 0.0,
            "e2e_ratio": statistics.median(e2e) if e2e else 0.0, "e2e_min": min(e2e, default=0.0),
            "e2e_max": max(e2e, default=0.0),
            "plain_tok_s": statistics.median(p["plain"]["tok_s"] for p in ok) if ok else 0.0,
            "spec_tok_s": statistics.median(p["spec"]["tok_s"] for p in ok) if ok else 0.0,
            "tokens_equal": len(tokens) == 1 and () not in tokens}


def table(pairs: list[dict], summary: dict) -> str:
    lines = [f"{'pair':<5}{'run':<6}{'exit':>5}{'tok/s':>8}{'TTFT s':>8}{'hit':>6}{'MB/tok':>8}{'cg GB':>7}{'RSS GB':>7}"
             f"{'disk GB':>8}{'rounds':>7}{'K=0':>5}{'probe':>6}{'verify':>7}{'accept':>7}{'draft s':>8}"]
    for i, p in enumerate(pairs):
        for name in p["order"]:
            r = p[name]
            lines.append(f"{i + 1:<5}{name:<6}{r['exit_code']:>5}{r.get('tok_s', 0):>8.3f}{r.get('ttft_s', 0):>8.1f}"
                         f"{r.get('hit_rate', 0):>6.0%}{r.get('mb_per_token', 0):>8.1f}{r['cgroup_peak_gb']:>7.2f}"
                         f"{r['rss_peak_gb']:>7.2f}" + (f"{r['disk_read_gb']:>8.2f}" if 'disk_read_gb' in r else f"{'-':>8}")
                         + (f"{r.get('n_rounds') or 0:>7}{r.get('n_plain_rounds') or 0:>5}"
                                                        f"{r.get('n_probes') or 0:>6}{r.get('n_verifies') or 0:>7}"
                                                        f"{r.get('acceptance') or 0:>7.0%}{r.get('draft_s') or 0:>8.2f}"
                                                        if name == "spec" else ""))
    s = summary
    lines.append(f"# spec/plain decode tok/s: median {s['ratio']:.3f} [{s['ratio_min']:.3f}-{s['ratio_max']:.3f}] over "
                 f"{s['n_pairs']} pairs (plain {s['plain_tok_s']:.3f}, spec {s['spec_tok_s']:.3f} tok/s); TTFT spec/plain "
                 f"{s['ttft_ratio']:.2f}; tokens equal in every run: {'yes' if s['tokens_equal'] else 'NO'}\n"
                 f"# end to end (prompt in, n tokens out: TTFT + decode), plain time / spec time: median {s['e2e_ratio']:.3f} "
                 f"[{s['e2e_min']:.3f}-{s['e2e_max']:.3f}]")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="the target checkpoint (bench/fullscale_checkpoint.py)")
    ap.add_argument("--draft", type=Path, default=None, help="the drafter (default: a random Qwen3-0.6B-shaped one)")
    ap.add_argument("--cap", default="8GB", help="the memory cap (cgroup v1, page cache counted)")
    ap.add_argument("--budget", default="4GB", help="specmoe --budget")
    ap.add_argument("-n", "--max-tokens", type=int, default=12, help="greedy tokens per run")
    ap.add_argument("--num-draft", type=int, default=None, help="specmoe --num-draft (K; default: the CLI's)")
    ap.add_argument("--predictor", default=None, choices=["none", "previous", "popularity", "spmoe"],
                    help="specmoe --predictor for the speculative runs (default: the CLI's)")
    ap.add_argument("--pairs", type=int, default=3, help="plain/speculative pairs, alternating which runs first")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="raw prompt")
    ap.add_argument("--io-mode", default="direct", choices=["buffered", "direct"], help="specmoe --io-mode")
    ap.add_argument("--read-mbps", type=float, default=None,
                    help="cap reads from the checkpoint's disk at this many MB/s (cgroup blkio throttle; default: none)")
    ap.add_argument("--out", default=None, help="also write the table and JSON line here")
    ap.add_argument("--log", default=None, help="the commands' output (default: discarded)")
    ap.add_argument("--note", default=None, help="a line for --out's header (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    try:
        try:
            cap = parse_gb(args.cap)
        except ValueError:
            raise ValueError(f"--cap {args.cap!r}: expected a size like 8GB") from None
        if not (args.model / "config.json").exists():
            raise ValueError(f"--model {args.model}: no config.json; expected a checkpoint directory")
        if available():
            raise ValueError(f"--cap needs a memory cgroup: {available()}")
        if args.read_mbps is not None:
            if not args.read_mbps > 0:
                raise ValueError(f"--read-mbps {args.read_mbps}: expected a positive rate in MB/s")
            if throttle_available():
                raise ValueError(f"--read-mbps needs a read throttle: {throttle_available()}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load0, t0 = loadavg(), time.time()
    tmp = Path(tempfile.mkdtemp(prefix="fullscale-spec-"))
    draft = args.draft or write_random_drafter(tmp / "drafter", args.model, hidden=1024, layers=28, seed=3)
    pairs = []
    with open(args.log or os.devnull, "a") as log:
        for i in range(args.pairs):
            order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
            pair = {"order": order}
            for name in order:
                pair[name] = run(args.model, draft if name == "spec" else None, args, cap, tmp / f"{name}-{i}.json", log)
            pairs.append(pair)
    summary = summarize(pairs)
    text = table(pairs, summary) + "\n" + json.dumps(
        {"bench": "fullscale_speculative", "model": str(args.model), "draft": str(draft), "cap": args.cap,
         "budget": args.budget, "tokens": args.max_tokens, "read_mbps": args.read_mbps, "summary": summary, "pairs": pairs,
         "load_average": {"before": load0, "after": loadavg()}})
    print(text)
    if args.out:
        write_result(args.out, "fullscale_speculative", argv, t0, load0, text, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
