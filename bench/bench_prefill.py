"""Prefill of a long prompt: bytes read against the unique experts it routes, and time against stock.

Physics: a prefill chunk of N tokens routes N * k (token, expert) pairs per MoE layer; with N in
the thousands nearly every expert of every layer is routed. The least a cache of any size must
read is each routed expert once per chunk (expert-major prefill, runtime/cache/expert_major.py).
Splitting the chunk into token groups that fit the cache instead re-reads experts the groups
evict from each other (measured: 37x the expert set at 25%). With files hot a read is a
memory copy, so prefill time should approach stock's: the FLOPs are the same, and what is added
is the copies, one host sync per expert batch, and the batching overhead.

Method: bench_decode.py's synthetic checkpoint (qwen3_moe, 8 MoE layers x 64 experts, top-4,
hidden 256) unless --model; a prompt of --tokens tokens from the calibration text; prefill as
mlx-lm's generate_step runs it (chunks of 2048 tokens, then the first token), timed to the first
token; specmoe through its own decode loop (offloaded_generate_step, as `specmoe generate` runs it:
the same chunks, the last decoder layer's experts skipped in chunks whose logits nobody reads, as
stock's lazy graph skips them, runtime/decode/kv_only.py; the first token as a device pass). Stock mlx-lm fully resident against specmoe at each budget, a fresh OffloadedModel (empty
cache) per trial, files hot (one warmup run of each variant first), variants interleaved per
trial. The first token's log-probabilities must equal stock's bit for bit. A third variant, stock with a
host sync per MoE layer (the router's choice read back before the experts run, their output evaluated
after, as an offloaded layer must), separates what routing on the host costs from what paging costs.
Beside wall time each
trial's CPU time (process_time: all the process's threads) is taken: on a machine shared with other
jobs wall time swings with their load, CPU time much less; the load average is printed.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from runtime.checkpoints import make_tiny  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel, offloaded_generate_step  # noqa: E402


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = (files("runtime") / "data" / "calibration.txt").read_text()
    ids = tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def first_token(model, ids: list[int]) -> tuple[float, float, int, np.ndarray]:
    """(wall seconds, CPU seconds, first token, its log-probabilities)."""
    t0, c0 = time.perf_counter(), time.process_time()
    token, logprobs = next(generate_step(mx.array(ids), model, max_tokens=1))
    return time.perf_counter() - t0, time.process_time() - c0, int(token), np.array(logprobs)


class HostSynced(nn.Module):
    """A stock expert module behind the host sync an offloaded model needs: the router's choice is read back
    (np.array) before the experts run and their output is evaluated after, as CachedSwitchGLU does."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def __call__(self, x, indices):
        np.array(indices)
        out = self.switch(x, indices)
        mx.eval(out)
        return out


def host_synced_stock(path: Path):
    """A second stock instance whose MoE blocks sync with the host per layer (the class is not patched)."""
    model, _ = load(str(path))
    for layer in model.model.layers:
        layer.mlp.switch_mlp = HostSynced(layer.mlp.switch_mlp)
    return model


def run_offloaded(path: Path, budget: str, ids: list[int]) -> dict:
    om = OffloadedModel.load(path, OffloadConfig(budget=budget, governor=None))
    try:
        routed: dict[int, set] = {}
        om.set_observer(lambda layer, e: routed.setdefault(layer, set()).update(np.unique(e).tolist()))
        c0 = om.counters()
        t0, cpu0 = time.perf_counter(), time.process_time()
        steps = offloaded_generate_step(om, mx.array(ids), max_tokens=1, sampler=lambda lp: mx.argmax(lp, axis=-1),
                                        after_prefill=om.cache.settle_inflight)
        token, logprobs = next(steps)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        steps.close()
        token, logprobs = int(token), np.array(logprobs)
        c1 = om.counters()
        unique = sum(len(s) for s in routed.values())
        unique_bytes = sum(len(s) * om.store.layout(l).expert_bytes for l, s in routed.items())
        return {"seconds": seconds, "cpu": cpu, "token": token, "logprobs": logprobs, "reads": c1["misses"] - c0["misses"],
                "bytes_read": c1["bytes_read"] - c0["bytes_read"], "unique_experts": unique,
                "unique_bytes": unique_bytes, "slots": min(om.plan.slots.values()),
                "expert_bytes_total": om.store.expert_bytes_total}
    finally:
        om.close()


SYNCED = "stock, host sync/layer"


def _spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: bench_decode's synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budgets", default="25%")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        stock, tok = load(str(path))
        synced = host_synced_stock(path)
        ids = prompt_ids(tok, args.tokens)
        budgets = args.budgets.split(",")
        first_token(stock, ids[:64])  # warmup: kernels built
        first_token(synced, ids[:64])
        for b in budgets:
            run_offloaded(path, b, ids[:64])  # warmup: files hot
        wall = {name: [] for name in ["stock", SYNCED] + budgets}
        cpu = {name: [] for name in ["stock", SYNCED] + budgets}
        loads, last = [], {}
        for _ in range(args.trials):  # interleaved, so drift hits all alike
            s, c, stock_token, stock_lp = first_token(stock, ids)
            wall["stock"].append(s)
            cpu["stock"].append(c)
            s, c, token, lp = first_token(synced, ids)
            if token != stock_token or not np.array_equal(lp, stock_lp):
                raise SystemExit("stock with host syncs: the first token's log-probabilities differ from stock")
            wall[SYNCED].append(s)
            cpu[SYNCED].append(c)
            for b in budgets:
                r = run_offloaded(path, b, ids)
                if r["token"] != stock_token or not np.array_equal(r["logprobs"], stock_lp):
                    raise SystemExit(f"specmoe {b}: the first token's log-probabilities differ from stock")
                wall[b].append(r["seconds"])
                cpu[b].append(r["cpu"])
                last[b] = r
            loads.append(os.getloadavg()[0])

    n = args.trials
    print(f"model: {args.model or 'synthetic qwen3_moe 8x64 experts, hidden 256'} "
          f"({next(iter(last.values()))['expert_bytes_total'] / 1e6:.1f} MB of experts); prompt {len(ids)} tokens; "
          f"time to first token, median (min-max) of {n} interleaved trials, files hot; "
          f"first-token log-probs equal stock bit for bit in every trial")
    print(f"load average (1 min) after each trial: {', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} cores")
    print(f"{'variant':<22}{'slots':>6} {'wall s':>24} {'CPU s':>22} {'wall vs stock':>20} {'CPU vs stock':>20}")
    results = {"stock": {"seconds": statistics.median(wall["stock"]), "spread": [min(wall["stock"]), max(wall["stock"])],
                         "cpu_seconds": statistics.median(cpu["stock"]), "cpu_spread": [min(cpu["stock"]), max(cpu["stock"])],
                         "tokens_per_s": len(ids) / statistics.median(wall["stock"])}}
    print(f"{'stock':<22}{'':>6} {_spread(wall['stock']):>24} {_spread(cpu['stock']):>22} {'1.00':>20} {'1.00':>20}")
    wr = [w / s for w, s in zip(wall[SYNCED], wall["stock"])]
    cr = [c / s for c, s in zip(cpu[SYNCED], cpu["stock"])]
    results[SYNCED] = {"seconds": statistics.median(wall[SYNCED]), "spread": [min(wall[SYNCED]), max(wall[SYNCED])],
                       "cpu_seconds": statistics.median(cpu[SYNCED]), "cpu_spread": [min(cpu[SYNCED]), max(cpu[SYNCED])],
                       "time_vs_stock": statistics.median(wr), "time_vs_stock_spread": [min(wr), max(wr)],
                       "cpu_vs_stock": statistics.median(cr), "cpu_vs_stock_spread": [min(cr), max(cr)]}
    print(f"{SYNCED:<22}{'':>6} {_spread(wall[SYNCED]):>24} {_spread(cpu[SYNCED]):>22} {_spread(wr):>20} {_spread(cr):>20}")
    for b in budgets:
        r = last[b]
        wr = [w / s for w, s in zip(wall[b], wall["stock"])]  # per trial: each against the stock run beside it
        cr = [c / s for c, s in zip(cpu[b], cpu["stock"])]
        ratio = r["bytes_read"] / r["unique_bytes"]
        results[b] = {"seconds": statistics.median(wall[b]), "spread": [min(wall[b]), max(wall[b])],
                      "cpu_seconds": statistics.median(cpu[b]), "cpu_spread": [min(cpu[b]), max(cpu[b])],
                      "tokens_per_s": len(ids) / statistics.median(wall[b]),
                      "time_vs_stock": statistics.median(wr), "time_vs_stock_spread": [min(wr), max(wr)],
                      "cpu_vs_stock": statistics.median(cr), "cpu_vs_stock_spread": [min(cr), max(cr)],
                      "reads": r["reads"], "unique_experts": r["unique_experts"],
                      "bytes_read": r["bytes_read"], "unique_bytes": r["unique_bytes"], "bytes_vs_unique": ratio,
                      "slots_per_layer": r["slots"]}
        print(f"{'specmoe ' + b:<22}{r['slots']:>6} {_spread(wall[b]):>24} {_spread(cpu[b]):>22} {_spread(wr):>20} {_spread(cr):>20}")
    print(f"{'bytes':<22}{'reads':>7}{'unique':>7}{'MB read':>9}{'MB unique':>10}{'read/unique':>12}")
    for b in budgets:
        r = results[b]
        print(f"{'specmoe ' + b:<22}{r['reads']:>7}{r['unique_experts']:>7}{r['bytes_read'] / 1e6:>9.1f}"
              f"{r['unique_bytes'] / 1e6:>10.1f}{r['bytes_vs_unique']:>12.3f}")
    print(json.dumps({"bench": "prefill", "prompt_tokens": len(ids), "trials": n, "load_average": loads,
                      "results": results}))


if __name__ == "__main__":
    main()
