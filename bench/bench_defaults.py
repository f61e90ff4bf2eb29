"""Decode through the public API: each one_sync mode and a plain greedy loop over the paged model, against stock.

Physics: a decode token computes every resident weight once plus top_k experts per MoE layer. Stock mlx-lm
holds every expert and syncs once a token (its loop queues token n+1 before it reads token n). The paged model
must also find each routed expert a slot: "off" reads each MoE layer's routing back to the host (one sync per
MoE layer) and reads what is absent before the layer's experts run; "on" looks the experts up on the device and
syncs once a token, plus one sync and a recompute from the first layer that missed when one was absent; "auto" is
the default (what it does: runtime/decode/plain.py, docs/flags.md). "loop" is the paged model in the plainest
greedy loop (model call, argmax, `.item()`), no pipelining: what any user could write without this engine.

Every variant decodes the same prompts greedily through `runtime.load` + `runtime.stream_generate` (the loop:
`runtime.load` + a Python loop over `engine.model.model`), files hot, one warmup first. Pairing: in each trial
the variants run in a fresh order and each prompt runs on the variant and on stock back to back (which first at
random); a trial's ratio is the variant's tok/s over its stock partner's, reported as median (min-max) and with
how many trials it won against "off" on the same trial. "stock (A/A)" is a second stock model paired the same
way: the run's noise floor. CPU per token is this process's (all threads) over the decoded tokens. Prints a table
per model and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load as mlx_load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.decode_models import each_model  # noqa: E402
from runtime import load, stream_generate  # noqa: E402
from runtime.decode.warm import warm_start  # noqa: E402

PROMPTS = [
    "The history of the river begins in the mountains, where",
    "def load_experts(path):\n    \"\"\"Read every expert",
    "Once upon a time a model was larger than the machine that ran it, and",
]
CONTROL = "stock (A/A)"
MODES = ("auto", "off", "on", "loop")


def _stock(model, ids: list[int], n: int) -> dict:
    gen = generate_step(mx.array(ids), model, max_tokens=n)
    next(gen)  # prefill + first token: not decode
    t0, p0, k = time.perf_counter(), time.process_time(), 0
    for _ in gen:
        k += 1
    return {"tokens": k, "wall": time.perf_counter() - t0, "cpu": time.process_time() - p0, "syncs": k}


def _api(engine, ids: list[int], n: int, mode: str) -> dict:
    t0 = p0 = None
    k, s0 = 0, engine.model.cache.host_syncs
    for r in stream_generate(engine, ids, n, one_sync=mode):
        if t0 is None:
            t0, p0, s0 = time.perf_counter(), time.process_time(), engine.model.cache.host_syncs
        else:
            k += 1
        if r.finish_reason:
            detail = r.detail
    out = {"tokens": k, "wall": time.perf_counter() - t0, "cpu": time.process_time() - p0,
           "syncs": engine.model.cache.host_syncs - s0}
    if detail is not None and hasattr(detail, "host_syncs_per_token"):
        out["syncs"] = detail.host_syncs_per_token * k  # up to the last token (the API's own count)
    return out


def _loop(engine, ids: list[int], n: int) -> dict:
    """The paged model in a plain greedy loop: call, argmax, read the token; nothing else."""
    om = engine.model
    model, cache = om.model, make_prompt_cache(om.model)
    warm_start(om)  # as the API: a full budget reads every expert first
    om.cache.settle_inflight()
    y = mx.argmax(model(mx.array(ids)[None], cache=cache)[:, -1, :], axis=-1)
    y.item()
    s0, t0, p0 = om.cache.host_syncs, time.perf_counter(), time.process_time()
    for _ in range(n - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        y.item()
    k = n - 1
    return {"tokens": k, "wall": time.perf_counter() - t0, "cpu": time.process_time() - p0,
            "syncs": om.cache.host_syncs - s0 + k}


def _per(runs: list[dict]) -> tuple[float, float, float]:
    """(tok/s, CPU ms per token, host syncs per token) over runs."""
    k = sum(r["tokens"] for r in runs)
    return k / sum(r["wall"] for r in runs), sum(r["cpu"] for r in runs) / k * 1e3, sum(r["syncs"] for r in runs) / k


def bench_model(name: str, path: Path, budgets: list[str], modes: list[str], tokens: int, trials: int,
                rng: random.Random) -> tuple[list[str], dict]:
    stock, tok = mlx_load(str(path))
    control, _ = mlx_load(str(path))
    ids = [list(tok.encode(p)) for p in PROMPTS]
    engines = {(b, m): load(path, budget=b) for b in budgets for m in modes}
    run = {}
    for (b, m), eng in engines.items():
        run[f"{b} {m}"] = (lambda e, mm: (lambda i: _loop(e, i, tokens) if mm == "loop" else _api(e, i, tokens, mm)))(eng, m)
    run[CONTROL] = lambda i: _stock(control, i, tokens)
    stock_run = lambda i: _stock(stock, i, tokens)  # noqa: E731
    for f in list(run.values()) + [stock_run]:  # warmup: files hot, kernels built
        f(ids[0])
    samples = {v: [] for v in run}  # per trial: (tok/s, stock tok/s, cpu ms, stock cpu ms, syncs)
    for _ in range(trials):
        order = list(run)
        rng.shuffle(order)
        for v in order:
            mine, theirs = [], []
            for i in ids:
                pair = [(mine, run[v]), (theirs, stock_run)]
                rng.shuffle(pair)
                for into, f in pair:
                    into.append(f(i))
            (tps, cpu, syncs), (s_tps, s_cpu, _) = _per(mine), _per(theirs)
            samples[v].append((tps, s_tps, cpu, s_cpu, syncs))
    expert_mb = next(iter(engines.values())).model.store.expert_bytes_total / 1e6
    for e in engines.values():
        e.close()
    lines = [f"## {name}: {path.name if name == 'embedded' else 'make_tiny qwen3_moe'} "
             f"({expert_mb:.1f} MB of experts); {tokens} tokens x {len(PROMPTS)} prompts, {trials} trials",
             f"{'variant':<14}{'tok/s':>8}{'vs stock (min-max)':>22}{'vs off':>8}{'won':>7}"
             f"{'CPU ms/tok':>12}{'CPU vs stock':>14}{'syncs/tok':>11}"]
    results = {}
    for v, s in samples.items():
        ratios = [t / st for t, st, *_ in s]
        cpu = [c / sc for _, _, c, sc, _ in s]  # > 1: more CPU per token than stock
        budget = v.split()[0]
        off = samples.get(f"{budget} off")
        vs_off = [a[0] / a[1] / (o[0] / o[1]) for a, o in zip(s, off)] if off and v != CONTROL else None
        results[v] = {"tokens_per_s": statistics.median(t for t, *_ in s), "ratio_vs_stock": statistics.median(ratios),
                      "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
                      "cpu_vs_stock": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu),
                      "cpu_ms_per_token": statistics.mean(c for _, _, c, _, _ in s),
                      "host_syncs_per_token": statistics.mean(x[4] for x in s),
                      "vs_off": statistics.median(vs_off) if vs_off else None,
                      "won_vs_off": sum(r > 1 for r in vs_off) if vs_off else None}
        r = results[v]
        lines.append(f"{v:<14}{r['tokens_per_s']:>8.1f}{r['ratio_vs_stock']:>10.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
                     + (f"{r['vs_off']:>8.2f}{r['won_vs_off']:>4}/{trials:<2}" if vs_off else f"{'':>8}{'':>7}")
                     + f"{r['cpu_ms_per_token']:>12.2f}{(r['cpu_vs_stock'] - 1) * 100:>+13.0f}%{r['host_syncs_per_token']:>11.2f}")
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,synthetic", help="comma list of: embedded, synthetic")
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ", ".join(MODES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables and JSON line to this file")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or "off" not in modes:
        ap.error(f"--modes {args.modes!r}; expected a comma list of {', '.join(MODES)} including off")
    load0 = os.getloadavg()
    rng = random.Random(0)
    lines, results = each_model(args.models, ap.error, lambda name, path: bench_model(
        name, path, args.budgets.split(","), modes, args.tokens, args.trials, rng))
    head = (f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
            f"at the start, {os.getloadavg()[0]:.2f} at the end; greedy, files hot, each prompt paired with stock; "
            f"vs off: the variant's ratio over off's in the same trial (won: trials > 1); CPU vs stock: median of "
            f"the pairs' CPU per token over stock's")
    lines = [head, ""] + lines
    lines.append(json.dumps({"bench": "defaults", "load_average": [load0[0], os.getloadavg()[0]],
                             "tokens": args.tokens, "trials": args.trials, "results": results}))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
