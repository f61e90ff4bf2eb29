"""Another offload library under the same cap: specmoe against mlx-vlm's `moe_offload`, interleaved.

    # once, outside the cap, with a python that has mlx-vlm (a separate venv; specmoe never imports it):
    VENV/bin/python -m bench.fullscale_peer repack --model DIR --out OFFLOAD_DIR
    # one peer run (what the driver launches under the cap):
    VENV/bin/python -m bench.fullscale_peer run --offload OFFLOAD_DIR --expert-cache-gb 4 -n 12 --json OUT
    # the comparison (the project's python; the peer runs with --python):
    python -m bench.fullscale_peer compare --model DIR --offload OFFLOAD_DIR --python VENV/bin/python \
        --cap 8GB --budget 4GB --expert-cache-gb 4 --repeats 2 -n 12 [--out FILE]

The peer (mlx-vlm 0.7.10, `mlx_vlm/moe_offload.py`): `repack` splits every MoE layer's stacked expert
tensors into one file per layer holding each expert's tensors under its own name, plus the resident
weights; `load_model` on that directory sees `offload_index.json` and swaps every switch layer for an
`OffloadedSwitchGLU` served by an `ExpertStore`: an LRU of single experts under a byte budget
(`expert_cache_gb`), each miss a lazy `mx.load` of that expert's tensors. Every MoE layer reads its
routed expert ids back to the host (`np.asarray(indices)`): one host sync per MoE layer per token.
mlx-vlm ships a `qwen3_moe` model, so a text-only Qwen3-30B-A3B checkpoint in mlx-community layout runs
as is (8-bit routers included); no adapter of its model code is needed. Two things are taken from
elsewhere: the tokenizer is mlx-lm's `load_tokenizer` on the same directory (mlx-vlm's `load` builds an
image processor), and decoding is mlx-vlm's own `generate_step` (`mlx_vlm.generate.ar`) at temperature
0 with its default chunked prefill, on the raw prompt, exactly as specmoe's `--raw-prompt` rows.

The comparison: under one memory cgroup cap (page cache counted, bench/fullscale_cgroup.py), `--repeats`
pairs of runs, alternating which engine goes first, each run starting cold (both checkpoints dropped
from the page cache). specmoe runs `generate --budget B` as bench/capped_run.py does; the peer runs with
an expert cache of the same size. Each run's tokens are compared with stock mlx-lm's resident tokens
read from `--reference` (a capped_run result file; its "stock resident" tokens, same prompt and n).
Reported: per run tok/s, TTFT, cgroup and RSS peaks, decode hit rate and MB read per token (the peer:
its store's decode misses x bytes per expert), tokens equal; then per engine the median [min-max] and
the per-pair ratios specmoe/peer of decode tok/s and peer/specmoe of TTFT. Both decode loops build step
n+1 before yielding token n; the peer's build runs every MoE layer (each reads its ids back), so its
TTFT is the time its own loop takes to deliver the first token (prefill and the second token's step),
and its decode rate counts n-1 tokens over n-1 steps, as specmoe's does.

Invariants: this module imports neither mlx-vlm nor specmoe at module level (the driver runs under the
project's python, the runner under the venv's); a run that fails or is killed is a row with its exit
code, never dropped; output is a table and one JSON line, `--out` adds bench/result_header's first line.
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
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REFERENCE = REPO / "bench" / "results" / "fullscale_qwen3-30b-a3b.txt"
ENGINES = ("specmoe", "peer")


# ---- the peer runner (the venv's python) ---------------------------------------------------------

def _need_mlx_vlm():
    try:
        from mlx_vlm import moe_offload
    except ImportError as e:
        raise ValueError(f"this python ({sys.executable}) has no mlx-vlm ({e}): install it into a separate venv "
                         "and run with that venv's python") from None
    return moe_offload


def repack(model_dir: Path, out_dir: Path) -> dict:
    """mlx-vlm's own repack of `model_dir` into `out_dir` (per-layer expert files + resident weights)."""
    moe_offload = _need_mlx_vlm()
    if not (model_dir / "config.json").exists():
        raise ValueError(f"--model {model_dir}: expected a checkpoint directory with config.json")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"--out {out_dir}: expected a new or empty directory")
    t0 = time.perf_counter()
    moe_offload.repack(str(model_dir), str(out_dir))
    return {"out": str(out_dir), "repack_s": time.perf_counter() - t0,
            "bytes": sum(p.stat().st_size for p in out_dir.rglob("*.safetensors"))}


def peer_run(offload_dir: Path, prompt: str, max_tokens: int, expert_cache_gb: float) -> dict:
    """Greedy decoding with mlx-vlm's offload on a repacked directory; the fields of fullscale_stock's result
    plus the expert store's counters (whole run, and decode: after the first token)."""
    _need_mlx_vlm()
    if not (offload_dir / "offload_index.json").exists():
        raise ValueError(f"--offload {offload_dir}: expected a repack output (offload_index.json); run `repack` first")
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model

    t0 = time.perf_counter()
    model = load_model(offload_dir, expert_cache_gb=expert_cache_gb)
    tokenizer = load_tokenizer(offload_dir)
    load_s = time.perf_counter() - t0
    store = model.moe_offload_store
    ids = tokenizer.encode(prompt)
    tokens, t_first, at_first = [], None, None
    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array([ids]), model, None, None, max_tokens=max_tokens, temperature=0.0):
        tokens.append(int(token.item() if hasattr(token, "item") else token))
        if t_first is None:
            t_first, at_first = time.perf_counter(), store.stats()
        if len(tokens) == max_tokens:
            break
    t_end = time.perf_counter()
    end = store.stats()
    hits, misses = end["hits"] - at_first["hits"], end["misses"] - at_first["misses"]
    expert_bytes = end["resident_bytes"] / end["resident_experts"] if end["resident_experts"] else 0.0  # all equal
    decode_s = t_end - t_first
    return {"tokens": tokens, "n_prompt_tokens": len(ids), "prefill_s": t_first - t0, "decode_s": decode_s,
            "tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0, "load_s": load_s,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "mb_read_per_token": misses * expert_bytes / 1e6 / max(1, len(tokens) - 1), "store": end}


# ---- the driver (the project's python) -----------------------------------------------------------

@dataclass
class Run:
    engine: str  # "specmoe" or "peer"
    repeat: int  # the pair it belongs to (0-based)
    first: bool  # it ran first in its pair
    exit_code: int  # the command's exit code (-9: killed)
    oom_killed: bool  # the OOM killer fired in the cgroup
    tok_s: float = 0.0  # decode tokens per second (after the first token)
    ttft_s: float = 0.0  # time to the first token (prefill)
    cgroup_peak_gb: float = 0.0  # memory.max_usage_in_bytes of the cgroup
    rss_peak_gb: float = 0.0  # the command's peak RSS
    hit_rate: float = 0.0  # decode expert-cache hit rate
    mb_per_token: float = 0.0  # decode expert MB read per token (the peer: misses x bytes per expert)
    tokens_equal: str = "n/a"  # vs stock mlx-lm's resident tokens: yes / no / n/a
    wall_s: float = 0.0  # the command's wall time (load included)


def schedule(repeats: int) -> list[tuple[str, str]]:
    """The order of each pair: specmoe first in even pairs, the peer first in odd ones."""
    return [ENGINES if i % 2 == 0 else ENGINES[::-1] for i in range(repeats)]


def reference_tokens(path: Path) -> list[int]:
    """Stock mlx-lm's resident tokens from a capped_run result file (its last line is the JSON summary)."""
    try:
        last = Path(path).read_text().rstrip("\n").splitlines()[-1]
        tokens = json.loads(last)["tokens"]["stock resident"]
    except (OSError, IndexError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--reference {path}: expected a capped_run result with \"stock resident\" tokens ({e})") from None
    if not tokens:
        raise ValueError(f"--reference {path}: its \"stock resident\" run has no tokens")
    return [int(t) for t in tokens]


def tokens_equal(tokens: list[int], reference: list[int] | None) -> str:
    if reference is None or len(tokens) > len(reference):
        return "n/a"
    return "yes" if tokens == reference[:len(tokens)] else "no"


def make_run(engine: str, repeat: int, first: bool, capped, result: dict | None, reference: list[int] | None) -> Run:
    """One row from the cgroup's measurement and the command's JSON (None when it failed)."""
    run = Run(engine, repeat, first, capped.exit_code, capped.oom_killed, cgroup_peak_gb=capped.cgroup_peak_bytes / 1e9,
              rss_peak_gb=capped.rss_peak_bytes / 1e9, wall_s=capped.wall_s)
    if result is None:
        return run
    stats = result.get("detail") or result  # specmoe generate --json keeps its stats under "detail"
    run.tok_s, run.ttft_s, run.hit_rate = stats["tokens_per_s"], stats["prefill_s"], stats.get("hit_rate", 0.0)
    run.mb_per_token = stats.get("mb_read_per_token", 0.0)
    run.tokens_equal = tokens_equal(result["tokens"], reference)
    return run


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[Run]) -> dict:
    """Per engine: median [min-max] of tok/s, TTFT and the peaks over its successful runs; per complete pair
    (both runs exited 0): specmoe/peer decode tok/s and peer/specmoe TTFT, as median [min-max]."""
    ok = [r for r in runs if r.exit_code == 0 and r.tok_s > 0]
    engines = {}
    for e in ENGINES:
        mine = [r for r in ok if r.engine == e]
        engines[e] = {"runs": len([r for r in runs if r.engine == e]), "ok": len(mine),
                      "oom_killed": sum(r.oom_killed for r in runs if r.engine == e),
                      "tokens_equal": "yes" if mine and all(r.tokens_equal == "yes" for r in mine)
                      else ("no" if any(r.tokens_equal == "no" for r in mine) else "n/a")}
        if mine:
            for field in ("tok_s", "ttft_s", "cgroup_peak_gb", "rss_peak_gb", "hit_rate", "mb_per_token"):
                engines[e][field] = _spread([getattr(r, field) for r in mine])
    pairs = {}
    for r in ok:
        pairs.setdefault(r.repeat, {})[r.engine] = r
    full = [p for _, p in sorted(pairs.items()) if len(p) == len(ENGINES)]
    out = {"engines": engines, "n_pairs": len(full)}
    if full:
        out["tok_s_ratio"] = _spread([p["specmoe"].tok_s / p["peer"].tok_s for p in full])
        out["ttft_ratio"] = _spread([p["peer"].ttft_s / p["specmoe"].ttft_s for p in full])
    return out


def _spread_text(spread: dict, fmt: str) -> str:
    return f"{spread['median']:{fmt}} [{spread['min']:{fmt}}-{spread['max']:{fmt}}]"


def _row_text(r: Run) -> str:
    return (f"{r.repeat + 1:<5}{r.engine:<9}{'yes' if r.first else 'no':>6}{r.exit_code:>6}{r.tok_s:>8.3f}"
            f"{r.ttft_s:>8.1f}{r.cgroup_peak_gb:>7.2f}{r.rss_peak_gb:>7.2f}{r.hit_rate:>6.0%}{r.mb_per_token:>8.1f}"
            f"{r.tokens_equal:>6}{r.wall_s:>8.0f}" + ("  OOM-killed" if r.oom_killed else ""))


def table(runs: list[Run], summary: dict) -> str:
    lines = [(f"{'pair':<5}{'engine':<9}{'first':>6}{'exit':>6}{'tok/s':>8}{'TTFT s':>8}{'cg GB':>7}{'RSS GB':>7}"
              f"{'hit':>6}{'MB/tok':>8}{'equal':>6}{'wall s':>8}")]
    lines += [_row_text(r) for r in runs]
    for e, s in summary["engines"].items():
        if "tok_s" not in s:
            lines.append(f"# {e}: no successful run ({s['runs']} runs, {s['oom_killed']} OOM-killed)")
            continue
        lines.append(f"# {e}: tok/s {_spread_text(s['tok_s'], '.3f')}, TTFT s {_spread_text(s['ttft_s'], '.1f')}, "
                     f"cgroup peak GB {_spread_text(s['cgroup_peak_gb'], '.2f')}, RSS peak GB "
                     f"{_spread_text(s['rss_peak_gb'], '.2f')}, hit {_spread_text(s['hit_rate'], '.2f')}, MB/token "
                     f"{_spread_text(s['mb_per_token'], '.0f')}; {s['ok']}/{s['runs']} runs ok; tokens equal to stock: "
                     f"{s['tokens_equal']}")
    if summary["n_pairs"]:
        t, q = summary["tok_s_ratio"], summary["ttft_ratio"]
        lines.append(f"# specmoe/peer decode tok/s: median {t['median']:.2f}x [{t['min']:.2f}-{t['max']:.2f}] over "
                     f"{summary['n_pairs']} pairs; peer/specmoe TTFT: median {q['median']:.2f}x [{q['min']:.2f}-{q['max']:.2f}]")
    else:
        lines.append("# no complete pair: no ratio")
    return "\n".join(lines)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def peer_cmd(python: str, offload: Path, prompt: str, n: int, expert_cache_gb: float, json_path: Path) -> list[str]:
    return [python, "-m", "bench.fullscale_peer", "run", "--offload", str(offload), "--prompt", prompt, "-n", str(n),
            "--expert-cache-gb", str(expert_cache_gb), "--json", str(json_path)]


def compare(model: Path, offload: Path, *, python: str, cap: int, budget: str, expert_cache_gb: float, repeats: int,
            n: int, prompt: str, io_mode: str, reference: list[int] | None, log, max_run_s: float | None = None) -> tuple:
    """Interleaved capped runs (see the module docstring); returns (runs, notes)."""
    from bench.capped_run import specmoe_cmd
    from bench.fullscale_bandwidth import checkpoint_files
    from bench.fullscale_cgroup import MemoryCgroup, drop_file_cache

    files = list(checkpoint_files(model)) + sorted(offload.rglob("*.safetensors"))
    tmp = Path(tempfile.mkdtemp(prefix="fullscale-peer-"))
    runs, notes = [], []
    for i, order in enumerate(schedule(repeats)):
        for k, engine in enumerate(order):
            j = tmp / f"{engine}-{i}.json"
            cmd = (specmoe_cmd(model, prompt, n, budget, io_mode, j) if engine == "specmoe"
                   else peer_cmd(python, offload, prompt, n, expert_cache_gb, j))
            drop_file_cache(files)  # every run starts cold
            with MemoryCgroup(cap) as cg:
                res = cg.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
            result = json.loads(j.read_text()) if res.exit_code == 0 and j.exists() else None
            runs.append(make_run(engine, i, k == 0, res, result, reference))
        slow = [r for r in runs[-2:] if max_run_s and r.wall_s > max_run_s]
        if slow and i + 1 < repeats:
            notes.append(f"stopped after pair {i + 1}: a run took {max(r.wall_s for r in slow):.0f} s "
                         f"(over --max-run-s {max_run_s:.0f})")
            break
    return runs, notes


def _gb(text: str) -> int:
    from runtime.cache.memory_limit import parse_memory_limit

    try:
        value = parse_memory_limit(text)
    except ValueError:
        value = None
    if not value:
        raise ValueError(f"--cap {text!r}: expected a size like 8GB")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--debug", action="store_true", help="tracebacks on errors")
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("repack", help="mlx-vlm's repack of a checkpoint (run once, outside the cap; needs mlx-vlm)")
    rp.add_argument("--model", required=True, type=Path, help="mlx-lm checkpoint directory")
    rp.add_argument("--out", required=True, type=Path, help="a new directory for the repacked checkpoint (~its size)")
    rn = sub.add_parser("run", help="one greedy run with mlx-vlm's offload (needs mlx-vlm); writes --json")
    rn.add_argument("--offload", required=True, type=Path, help="a `repack` output directory")
    rn.add_argument("--prompt", default=None, help="raw prompt (default: bench/capped_run.py's)")
    rn.add_argument("-n", "--max-tokens", type=int, default=12, help="greedy tokens to generate")
    rn.add_argument("--expert-cache-gb", type=float, default=4.0, help="mlx-vlm's expert LRU budget, GB (1e9 bytes)")
    rn.add_argument("--json", required=True, type=Path, help="where to write the result")
    cp = sub.add_parser("compare", help="specmoe vs the peer under one cgroup cap, interleaved pairs")
    cp.add_argument("--model", required=True, type=Path, help="the checkpoint specmoe reads (and the repack came from)")
    cp.add_argument("--offload", required=True, type=Path, help="its `repack` output, for the peer")
    cp.add_argument("--python", required=True, help="a python with mlx-vlm installed (the peer's venv)")
    cp.add_argument("--cap", default="8GB", help="the memory cap both engines run under (cgroup v1, page cache counted)")
    cp.add_argument("--budget", default="4GB", help="specmoe --budget")
    cp.add_argument("--expert-cache-gb", type=float, default=4.0, help="the peer's expert cache, GB (match --budget)")
    cp.add_argument("--repeats", type=int, default=2, help="pairs of runs, alternating which engine goes first")
    cp.add_argument("-n", "--max-tokens", type=int, default=12, help="greedy tokens per run")
    cp.add_argument("--prompt", default=None, help="raw prompt (default: bench/capped_run.py's)")
    cp.add_argument("--io-mode", default="direct", choices=["buffered", "direct"], help="specmoe --io-mode")
    cp.add_argument("--reference", default=str(DEFAULT_REFERENCE),
                    help="capped_run result whose \"stock resident\" tokens the runs are compared with ('' for none)")
    cp.add_argument("--max-run-s", type=float, default=None, help="stop after a pair in which a run took longer")
    cp.add_argument("--out", default=None, help="also write the table and JSON line here")
    cp.add_argument("--log", default=None, help="the commands' output (default: discarded)")
    cp.add_argument("--note", default="", help="a line for --out's header (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    try:
        return _dispatch(args, argv)
    except ValueError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args, argv) -> int:
    from bench.capped_run import DEFAULT_PROMPT

    if args.command == "repack":
        print(json.dumps(repack(args.model, args.out)))
        return 0
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.max_tokens < 2:
        raise ValueError(f"-n {args.max_tokens}: expected at least 2 tokens (decode speed needs a second one)")
    if args.expert_cache_gb <= 0:
        raise ValueError(f"--expert-cache-gb {args.expert_cache_gb}: expected a positive size in GB")
    if args.command == "run":
        result = peer_run(args.offload, prompt, args.max_tokens, args.expert_cache_gb)
        args.json.write_text(json.dumps(result))
        print(json.dumps(result))
        return 0
    return _compare_main(args, argv, prompt)


def _compare_main(args, argv, prompt: str) -> int:
    from bench.fullscale_cgroup import available
    from bench.result_header import loadavg, write_result

    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: expected at least 1 pair")
    if not (args.model / "config.json").exists():
        raise ValueError(f"--model {args.model}: expected a checkpoint directory with config.json")
    if not (args.offload / "offload_index.json").exists():
        raise ValueError(f"--offload {args.offload}: expected a repack output (offload_index.json)")
    if not (Path(args.python).is_file() and os.access(args.python, os.X_OK)):
        raise ValueError(f"--python {args.python}: expected an executable python with mlx-vlm")
    cap = _gb(args.cap)
    why = available()
    if why:
        raise ValueError(f"--cap needs a memory cgroup: {why}")
    reference = reference_tokens(Path(args.reference)) if args.reference else None
    load0, t0 = loadavg(), time.time()
    with open(args.log or os.devnull, "a") as log:
        runs, notes = compare(args.model, args.offload, python=args.python, cap=cap, budget=args.budget,
                              expert_cache_gb=args.expert_cache_gb, repeats=args.repeats, n=args.max_tokens,
                              prompt=prompt, io_mode=args.io_mode, reference=reference, log=log,
                              max_run_s=args.max_run_s)
    summary = summarize(runs)
    summary.update({"model": str(args.model), "offload": str(args.offload), "cap_gb": cap / 1e9, "budget": args.budget,
                    "expert_cache_gb": args.expert_cache_gb, "notes": notes, "runs": [asdict(r) for r in runs],
                    "load_average": {"before": load0, "after": loadavg()}})
    text = table(runs, summary) + "".join(f"\n# {n}" for n in notes) + "\n" + json.dumps(summary)
    print(text)
    if args.out:
        write_result(args.out, "fullscale_peer", argv, t0, load0, text, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
