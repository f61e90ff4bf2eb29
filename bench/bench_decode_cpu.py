"""CPU per decoded token of the default decode path against stock mlx-lm, paired, at several budgets.

Physics: a decode token on MLX's CPU backend costs the same arithmetic with or without paging (every routed
expert's weights are multiplied once); what paging adds is host work. Below a full budget the default reads each
MoE layer's routing back to the host (one sync per MoE layer) and, per layer, releases the previous token's slots,
looks the experts up, books recency and hits, pins the slots and builds the slot index array, in Python. On a
model whose tokens take a few ms (the embedded pair: 8 MoE layers, ~5 ms tokens) that per-layer Python is a large
share of the token; on the synthetic 12 x 64-expert qwen3_moe (~20 ms tokens) a small one. Process CPU time
(time.process_time: every thread, so MLX's workers and the I/O threads too) per token is less sensitive to other
load on the machine than wall time.

Rows: "<budget> default" is `runtime.stream_generate` with the defaults; "stock (A/A)" a second stock model (the
run's noise floor); "stock, synced per layer" a stock model whose expert modules read their routing back to the
host before running (np.array of the ids, nothing else): what one sync per MoE layer costs by itself. In each repeat
the rows run in a fresh order, and every prompt runs on the row's model and on stock back to back (which first at
random); a repeat's ratio is the row's CPU per token over its stock partner's. Greedy tokens must equal stock's for
every pair (mismatches are counted and reported; any is a failure). Prints a table per model, ends with one JSON line.
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
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load as mlx_load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from bench.decode_models import each_model  # noqa: E402
from runtime import load, stream_generate  # noqa: E402

PROMPTS = [
    "The history of the river begins in the mountains, where",
    "def load_experts(path):\n    \"\"\"Read every expert",
    "Once upon a time a model was larger than the machine that ran it, and",
]
CONTROL, SYNCED = "stock (A/A)", "stock, synced per layer"


class SyncedExperts(nn.Module):
    """Wraps one stock expert module: reads the routed ids back to the host, then runs the module unchanged."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a child: the wrapper adds no parameters

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        np.array(indices)
        return self.inner(x, indices)


def synced_per_layer(model) -> None:
    """Wrap every `switch_mlp` of this model instance (the class is untouched)."""
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "switch_mlp"):
            mlp.switch_mlp = SyncedExperts(mlp.switch_mlp)


def _stock(model, ids: list[int], n: int) -> tuple[float, int, list[int]]:
    """(CPU seconds, decoded tokens, all tokens) of mlx-lm's generate_step; the first token (prefill) not timed."""
    gen = generate_step(mx.array(ids), model, max_tokens=n)
    tokens = [int(next(gen)[0])]
    p0 = time.process_time()
    for token, _ in gen:
        tokens.append(int(token))
    return time.process_time() - p0, len(tokens) - 1, tokens


def _default(engine, ids: list[int], n: int) -> tuple[float, int, list[int]]:
    p0, tokens = None, []
    for r in stream_generate(engine, ids, n):
        tokens.append(r.token)
        if p0 is None:
            p0 = time.process_time()
    return time.process_time() - p0, len(tokens) - 1, tokens


def bench_model(name: str, path: Path, budgets: list[str], tokens: int, repeats: int, rng: random.Random):
    stock, tok = mlx_load(str(path))
    control, _ = mlx_load(str(path))
    synced, _ = mlx_load(str(path))
    synced_per_layer(synced)
    ids = [list(tok.encode(p)) for p in PROMPTS]
    engines = {b: load(path, budget=b) for b in budgets}
    run = {f"{b} default": (lambda e: lambda i: _default(e, i, tokens))(e) for b, e in engines.items()}
    run[CONTROL] = lambda i: _stock(control, i, tokens)
    run[SYNCED] = lambda i: _stock(synced, i, tokens)
    stock_run = lambda i: _stock(stock, i, tokens)  # noqa: E731
    for f in list(run.values()) + [stock_run]:  # warmup: files hot, kernels built, caches warm
        f(ids[0])
    ratios = {v: [] for v in run}
    cpu_ms = {v: [] for v in run}
    mismatches = {v: 0 for v in run}
    for _ in range(repeats):
        order = list(run)
        rng.shuffle(order)
        for v in order:
            mine = [0.0, 0]
            theirs = [0.0, 0]
            for i in ids:
                pair = [(mine, run[v]), (theirs, stock_run)]
                rng.shuffle(pair)
                out = []
                for into, f in pair:
                    cpu, k, toks = f(i)
                    into[0] += cpu
                    into[1] += k
                    out.append(toks)
                mismatches[v] += out[0] != out[1]
            ratios[v].append((mine[0] / mine[1]) / (theirs[0] / theirs[1]))
            cpu_ms[v].append(mine[0] / mine[1] * 1e3)
    for e in engines.values():
        e.close()
    lines = [f"## {name}: {tokens} tokens x {len(PROMPTS)} prompts, {repeats} repeats",
             f"{'row':<26}{'CPU ms/tok':>11}{'CPU vs stock, median (min-max)':>34}{'token mismatches':>18}"]
    results = {}
    for v, r in ratios.items():
        med, lo, hi = statistics.median(r), min(r), max(r)
        results[v] = {"cpu_vs_stock": med, "cpu_min": lo, "cpu_max": hi, "ratios": r,
                      "cpu_ms_per_token": statistics.median(cpu_ms[v]), "mismatches": mismatches[v]}
        lines.append(f"{v:<26}{statistics.median(cpu_ms[v]):>11.2f}"
                     f"{f'{(med - 1) * 100:+.1f}% ({(lo - 1) * 100:+.1f}% to {(hi - 1) * 100:+.1f}%)':>34}{mismatches[v]:>18}")
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="synthetic,embedded", help="comma list of: synthetic, embedded")
    ap.add_argument("--budgets", default="50%,25%,100%")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--note", default="", help="appended to the header line (e.g. what else ran on the machine)")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables and JSON line to this file")
    args = ap.parse_args()
    load0 = os.getloadavg()
    rng = random.Random(0)
    lines, results = each_model(args.models, ap.error, lambda name, path: bench_model(
        name, path, args.budgets.split(","), args.tokens, args.repeats, rng))
    load1 = os.getloadavg()
    command = "python bench/bench_decode_cpu.py " + " ".join(sys.argv[1:])
    head = (f"{command} | {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} | load average before "
            f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after {load1[0]:.2f}; greedy, files hot, each prompt "
            f"paired with stock; CPU vs stock: the pairs' process CPU per token over stock's"
            + (f"; {args.note}" if args.note else ""))
    lines = [head, ""] + lines
    lines.append(json.dumps({"bench": "decode_cpu", "load_average": [load0[0], load1[0]], "tokens": args.tokens,
                             "repeats": args.repeats, "results": results}))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if any(r["mismatches"] for m in results.values() for r in m.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
