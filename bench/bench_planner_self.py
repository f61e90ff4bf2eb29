"""Predicted against measured: the planner's cost model fed this machine's own measurements.

Physics: the planner adds the terms of one decode forward (runtime/plan/planner.py):
    dense + experts = max(bytes / memory bandwidth, FLOPs / compute rate)   resident and routed weights
    I/O             = missed expert bytes / page-cache (or disk) read bandwidth
    sync            = MoE layers x sync_ms_per_layer                       (the one fitted constant)
On a Mac GPU the first term is bandwidth-bound. On this CPU it is compute-bound by far: MLX's CPU
4-bit matrix-vector kernels run at ~1-2 GFLOP/s, so multiplying a token through a 147 KB expert
takes ~0.2 ms while reading it from RAM takes ~0.01 ms. So the compute rate fed to the model (the
planner's `gpu_tflops`) is the measured rate of `gather_qmm` at the model's decode shapes with
float32 activations, the op behind 80% of a token's FLOPs. Per-layer work that is neither a
matmul nor I/O (norms, attention, routing, op dispatch, our host sync) is what the constant absorbs.

Steps, on the synthetic checkpoint bench_decode.py uses (qwen3_moe, 8 layers x 64 experts, top-4,
4-bit group 32, float32 scales):
1. measure the machine: numpy copy GB/s; expert reads as the runtime issues them (the store's 9
   ranges per expert, one expert at a time) from the hot page cache and with O_DIRECT; gather_qmm
   GFLOP/s. The CPU is shared with other jobs, so reads and GFLOP/s are re-sampled in every pass;
2. decode greedily with stock mlx-lm and with specmoe at each row's budget, interleaved per prompt
   in a fresh random order, counting expert-cache hits and misses per decoded token; a row's speed
   is the fit row's median times the row's median speed ratio to it within a pass (paired_speeds);
3. predict each row's tok/s with planner.forward_time, the measured profile and the measured hit
   rate (misses from the page cache; from the disk for "direct" rows), with sync_ms_per_layer
   fitted on ONE row; the other rows are tests. Machine numbers are medians of their per-pass samples.
   Rows with many more misses than the fit row also get the cost of one miss, measured against modelled.
Bytes per expert and resident bytes come from the store, not model_costs: model_costs assumes
16-bit scales and biases, this checkpoint has 32-bit ones (0.75 instead of 0.625 bytes/weight).

Prints the machine, a table (row, hit rate, measured, predicted, error, fit/test) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine_probe import ExpertReads, GatherRate, device_gbps, memory_gbps  # noqa: E402
from runtime.plan import MacProfile, measured_profile  # noqa: E402
from runtime.plan import ModelCosts  # noqa: E402
from runtime.plan import CostConstants, ForwardTime, HitRates, forward_time  # noqa: E402

PROMPTS = [
    "The history of the river begins in the mountains, where",
    "def load_experts(path):\n    \"\"\"Read every expert",
    "Once upon a time a model was larger than the machine that ran it, and",
]


# --- prediction: pure functions of measurements (tests/test_planner_self.py) -----------------


@dataclass(frozen=True)
class MeasuredRow:
    label: str  # row name, e.g. "50%" or "7% direct"
    io_mode: str  # "buffered": misses are preads from the (hot) page cache; "direct": O_DIRECT from disk
    hit_rate: float  # expert-cache hits / expert lookups over decoded tokens
    misses_per_token: float  # demand loads per decoded token
    tok_per_s: float  # decode tokens per second (paired median of interleaved passes, see paired_speeds)


@dataclass(frozen=True)
class PredictedRow:
    measured: MeasuredRow  # what the runtime did
    role: str  # "fit" (sync_ms_per_layer solved on it) or "test" (compared only)
    step: ForwardTime  # the planner's decode forward for this row

    @property
    def tok_per_s(self) -> float:
        return 1000.0 / self.step.total_ms

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.tok_per_s / self.measured.tok_per_s - 1.0)


def with_store_bytes(costs: ModelCosts, *, expert_bytes: int, resident_bytes: int,
                     resident_read_bytes_per_token: int, kv_bytes_per_token: int) -> ModelCosts:
    """`costs` with byte counts taken from the real store (parameter counts are kept)."""
    return replace(costs, expert_bytes=expert_bytes,
                   expert_total_bytes=expert_bytes * costs.n_experts * costs.n_moe_layers,
                   resident_bytes=resident_bytes, resident_read_bytes_per_token=resident_read_bytes_per_token,
                   kv_bytes_per_token=kv_bytes_per_token)


def row_hits(row: MeasuredRow) -> HitRates:
    """Cache hits as measured; misses are served by the page cache (buffered, files hot) or the disk (direct)."""
    miss = 1.0 - row.hit_rate
    if row.io_mode == "buffered":
        return HitRates(row.hit_rate, miss, "measured; misses from the page cache")
    if row.io_mode == "direct":
        return HitRates(row.hit_rate, 0.0, "measured; misses from the disk")
    raise ValueError(f"io_mode {row.io_mode!r} of row {row.label!r}; expected 'buffered' or 'direct'")


def predict_rows(costs: ModelCosts, mac: MacProfile, rows: list[MeasuredRow], fit_label: str,
                 context_tokens: int) -> tuple[float, list[PredictedRow]]:
    """(fitted sync_ms_per_layer, one prediction per row); the constant is solved on `fit_label` alone.

    The fit makes that row's predicted forward time equal its measured 1/tok_per_s; when the model
    already predicts a slower forward than measured, the constant is clamped at 0 (it cannot be negative).
    """
    fits = [r for r in rows if r.label == fit_label]
    if len(fits) != 1:
        raise ValueError(f"--fit {fit_label!r} must name exactly one row of {[r.label for r in rows]}")
    fit = fits[0]
    bare = forward_time(costs, mac, row_hits(fit), CostConstants(sync_ms_per_layer=0.0),
                        context_tokens=context_tokens)
    sync_ms = max(0.0, (1000.0 / fit.tok_per_s - bare.total_ms) / costs.n_moe_layers)
    constants = CostConstants(sync_ms_per_layer=sync_ms)
    predicted = [
        PredictedRow(r, "fit" if r is fit else "test",
                     forward_time(costs, mac, row_hits(r), constants, context_tokens=context_tokens))
        for r in rows
    ]
    return sync_ms, predicted


def error_bound_pct(rows: list[PredictedRow]) -> float | None:
    """Largest |error| over the test rows, rounded up to a whole 5%; None without test rows."""
    errors = [abs(r.error_pct) for r in rows if r.role == "test"]
    return 5.0 * math.ceil(max(errors) / 5.0) if errors else None


def miss_cost_ms(rows: list[PredictedRow], min_extra_misses: float = 1.0) -> dict[str, tuple[float, float]]:
    """{row: (measured, modelled) ms per extra miss against the fit row}, for rows with enough extra misses."""
    fit = next(r for r in rows if r.role == "fit")
    out = {}
    for r in rows:
        extra = r.measured.misses_per_token - fit.measured.misses_per_token
        if extra >= min_extra_misses:  # fewer extra misses leave the difference inside the noise
            out[r.measured.label] = ((1000 / r.measured.tok_per_s - 1000 / fit.measured.tok_per_s) / extra,
                                     (r.step.total_ms - fit.step.total_ms) / extra)
    return out


def spread_pct(samples: list[float]) -> float:
    """Half the interquartile range over the median, in percent: the pass-to-pass noise of a quantity."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4)
    return 50.0 * (high - low) / statistics.median(samples)


def paired_speeds(passes: list[dict[str, float]], reference: str) -> dict[str, tuple[float, float]]:
    """{variant: (tok/s, spread %)}: the reference's median speed times the median of each variant's
    speed over the reference's in the same pass. Slowdowns of a shared CPU that last a pass hit both
    sides of a ratio, so it is far steadier than each variant's own median; spread is that of the ratios
    (of the raw speeds for the reference itself)."""
    base = statistics.median(p[reference] for p in passes)
    out = {}
    for name in passes[0]:
        ratios = [p[name] / p[reference] for p in passes]
        samples = [p[name] for p in passes] if name == reference else ratios
        out[name] = (base * statistics.median(ratios), spread_pct(samples))
    return out


# --- measuring decode --------------------------------------------------------------------------


def decode_once(model, tokenizer, prompt: str, n_tokens: int, om=None) -> tuple[float, int, int, int]:
    """(decode seconds, decoded tokens, cache hits, cache misses) for one prompt; prefill is excluded."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n_tokens)
    next(steps)  # prefill + first token
    before = om.counters() if om else None
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    if not om:
        return seconds, n, 0, 0
    after = om.counters()
    return seconds, n, after["hits"] - before["hits"], after["misses"] - before["misses"]


def store_costs(path: Path, store) -> ModelCosts:
    """ModelCosts from config.json, with bytes from the store (its scales may be 32-bit)."""
    from runtime.plan import config_quantization, model_costs

    config = store.config
    bits, group_size, mode = config_quantization(config) or (16, 64, "affine")
    costs = model_costs(config, bits=bits, group_size=group_size, mode=mode, name=path.name)
    resident = store.resident_tensors()
    embed_bytes = sum(t.nbytes for name, t in resident.items() if name.startswith("model.embed_tokens."))
    act_bytes = 4 if resident["model.norm.weight"].dtype == "F32" else 2  # KV is kept in the activation dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return with_store_bytes(
        costs, expert_bytes=store.layout(store.moe_layers[0]).expert_bytes, resident_bytes=store.resident_bytes,
        resident_read_bytes_per_token=store.resident_bytes - embed_bytes + embed_bytes // config["vocab_size"],
        kv_bytes_per_token=config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * act_bytes,
    )


def parse_rows(text: str) -> list[tuple[str, str, str]]:
    """"100%,7% direct" -> [(label, budget, io_mode)]; a trailing "direct" reads misses with O_DIRECT."""
    rows = []
    for item in text.split(","):
        budget, _, mode = item.strip().partition(" ")
        rows.append((item.strip(), budget, mode or "buffered"))
    return rows


def measure(path: Path, specs, n_tokens: int, n_trials: int, tmp: Path) -> dict:
    """Every raw sample: machine terms and each variant's decode tok/s per pass, hit/miss counts."""
    from mlx_lm import load

    from runtime.decode import OffloadConfig, OffloadedModel
    from storage import ExpertStore

    store = ExpertStore.open(path)
    costs = store_costs(path, store)
    layout = store.layout(store.moe_layers[0])
    out = {"costs": costs, "disk_gbps": device_gbps(tmp, layout.expert_bytes), "mem_gbps": memory_gbps(),
           "gflops": [], "hot_gbps": [], "direct_gbps": []}
    direct, hot = ExpertReads(store, "direct"), ExpertReads(store, "buffered")  # hot last: files stay hot
    rate = GatherRate(layout, costs.top_k)
    loaded = {"stock": (*load(str(path)), None)}
    for label, budget, io_mode in specs:
        om = OffloadedModel.load(path, OffloadConfig(budget=budget, io_mode=io_mode))
        loaded[label] = (om.model, om.tokenizer, om)
    for model, tokenizer, om in loaded.values():  # warmup: kernels built, caches filled
        for prompt in PROMPTS:
            decode_once(model, tokenizer, prompt, 8, om)
    out["passes"] = []  # per (trial, prompt): {variant: decode tok/s}, the raw samples
    out["counts"] = {name: [0, 0, 0] for name in loaded}  # decoded tokens, hits, misses
    for i in range(n_trials * len(PROMPTS)):
        prompt = PROMPTS[i % len(PROMPTS)]
        out["gflops"].append(rate.gflops())
        out["hot_gbps"].append(hot.gbps(64))
        out["direct_gbps"].append(direct.gbps(16))
        order = list(loaded)
        random.Random(i).shuffle(order)  # a fresh order every pass: no variant always follows another
        out["passes"].append({})
        for name in order:
            model, tokenizer, om = loaded[name]
            seconds, n, hits, misses = decode_once(model, tokenizer, prompt, n_tokens, om)
            out["passes"][-1][name] = n / seconds
            out["counts"][name] = [a + b for a, b in zip(out["counts"][name], (n, hits, misses))]
    out["slots"] = {label: loaded[label][2].plan.slots[store.moe_layers[0]] for label, _, _ in specs}
    out["prompt_tokens"] = statistics.mean(len(loaded["stock"][1].encode(p)) for p in PROMPTS)
    for _, _, om in loaded.values():
        if om:
            om.close()
    direct.close()
    hot.close()
    store.close()
    return out


# --- reporting ---------------------------------------------------------------------------------


def report(data: dict, specs, fit: str, context: int, ram_bytes: int) -> dict:
    """Profile (medians of the samples) and predictions of paired measured speeds; prints the table."""
    pick = statistics.median
    costs = data["costs"]
    gflops, hot, direct = pick(data["gflops"]), pick(data["hot_gbps"]), pick(data["direct_gbps"])
    mac = measured_profile("this-machine", ram_bytes=ram_bytes, mem_bandwidth_gbps=data["mem_gbps"],
                           ssd_read_gbps=direct, page_cache_read_gbps=hot, gpu_tflops=gflops / 1e3)
    speeds = paired_speeds(data["passes"], fit)
    rows = []
    for label, _, io_mode in specs:
        decoded, hits, misses = data["counts"][label]
        rows.append(MeasuredRow(label, io_mode, hits / max(1, hits + misses), misses / decoded, speeds[label][0]))
    sync_ms, predicted = predict_rows(costs, mac, rows, fit, context)
    stock = speeds["stock"][0]
    gap_ms = (1000 / next(r.tok_per_s for r in rows if r.label == fit) - 1000 / stock) / costs.n_moe_layers
    bound = error_bound_pct(predicted)
    step = predicted[0].step
    print(f"medians: gather_qmm {gflops:.2f} GFLOP/s, page cache {hot:.2f} GB/s, O_DIRECT {direct:.3f} GB/s; "
          f"forward = dense {step.dense_ms:.2f} + experts {step.expert_compute_ms:.2f} ms (FLOP-bound) "
          f"+ sync {step.sync_ms:.2f} ms + I/O")
    spread = {label: value[1] for label, value in speeds.items()}
    print(f"{'row':<11}{'slots':>6}{'hit rate':>10}{'misses/tok':>12}{'measured':>10}{'spread':>8}{'predicted':>11}"
          f"{'error':>8}{'I/O ms':>8}  role")
    for r in predicted:
        m = r.measured
        print(f"{m.label:<11}{data['slots'][m.label]:>6}{m.hit_rate:>10.3f}{m.misses_per_token:>12.2f}"
              f"{m.tok_per_s:>10.1f}{spread[m.label]:>7.0f}%{r.tok_per_s:>11.1f}{r.error_pct:>+7.1f}%"
              f"{r.step.io_ms:>8.2f}  {r.role}")
    print(f"measured: the {fit} row's median over {len(data['passes'])} passes times each row's median speed ratio "
          f"to it in the same pass; spread: half the interquartile range of those ratios (of the {fit} row's "
          f"speeds for itself), the noise of a shared CPU")
    miss_cost = miss_cost_ms(predicted)
    for label, (measured_ms, model_ms) in miss_cost.items():
        print(f"one miss, {label} vs {fit}: measured {measured_ms:.2f} ms, modelled {model_ms:.2f} ms "
              f"(delta ms/token over delta misses/token)")
    print(f"stock mlx-lm {stock:.1f} tok/s, spread {spread['stock']:.0f}% (reference, not predicted). "
          f"Fitted sync_ms_per_layer = {sync_ms:.3f} ms on the {fit!r} row only; cross-check, not fitted: "
          f"specmoe {fit} minus stock = {gap_ms:+.3f} ms/layer")
    print("error bound: " + (f"within +-{bound:.0f}% on the {len(rows) - 1} test rows" if bound is not None
                             else "no test rows"))
    return {"gather_qmm_gflops": gflops, "page_cache_read_gbps": hot, "ssd_read_gbps": direct,
            "sync_ms_per_layer": sync_ms, "specmoe_minus_stock_ms_per_layer": gap_ms, "stock_tok_s": stock,
            "error_bound_pct": bound,
            "miss_cost_ms": {label: {"measured": m, "modelled": p} for label, (m, p) in miss_cost.items()},
            "raw_median_tok_s": {name: statistics.median(p[name] for p in data["passes"]) for name in speeds},
            "rows": [{"row": r.measured.label, "role": r.role, "hit_rate": r.measured.hit_rate,
                      "misses_per_token": r.measured.misses_per_token, "measured_tok_s": r.measured.tok_per_s,
                      "spread_pct": spread[r.measured.label], "predicted_tok_s": r.tok_per_s,
                      "error_pct": r.error_pct, "predicted_io_ms": r.step.io_ms}
                     for r in predicted]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build bench_decode's synthetic qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=10, help="passes over the prompts (each pass runs every variant)")
    ap.add_argument("--rows", default="100%,50%,25%,7%,7% direct",
                    help="budgets, comma-separated; 7%% of 64 experts = 4 slots, the minimum; "
                         "' direct' reads misses with O_DIRECT instead of from the hot page cache")
    ap.add_argument("--fit", default="100%", help="the one row the overhead constant is fitted on")
    args = ap.parse_args()

    import psutil

    from runtime.checkpoints import make_tiny

    specs = parse_rows(args.rows)
    if args.fit not in [label for label, _, _ in specs]:
        ap.error(f"--fit {args.fit!r} is not one of --rows {args.rows!r}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        data = measure(path, specs, args.tokens, args.trials, Path(tmp))
    costs = data["costs"]
    context = round(data["prompt_tokens"] + args.tokens / 2)  # mean context over the decoded tokens
    print(f"model: {costs.n_moe_layers} MoE layers x {costs.n_experts} experts, top-{costs.top_k}, "
          f"{costs.expert_bytes} B/expert (from the store); greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, "
          f"{args.trials} trials x {len(PROMPTS)} passes, variants interleaved in each, context ~{context} tokens")
    print(f"machine: memory {data['mem_gbps']:.1f} GB/s (numpy copy, read+write): one token's weights "
          f"{(costs.resident_read_bytes_per_token + costs.expert_bytes_per_token) / data['mem_gbps'] / 1e6:.2f} ms; "
          f"disk {data['disk_gbps']:.2f} GB/s (whole records, 4 in flight); per pass ({len(data['gflops'])}): "
          f"gather_qmm {min(data['gflops']):.2f}-{max(data['gflops']):.2f} GFLOP/s, "
          f"page cache {min(data['hot_gbps']):.2f}-{max(data['hot_gbps']):.2f} GB/s, "
          f"O_DIRECT {min(data['direct_gbps']):.3f}-{max(data['direct_gbps']):.3f} GB/s (store ranges)")
    results = report(data, specs, args.fit, context, psutil.virtual_memory().total)
    print(json.dumps({
        "bench": "planner_self", "kind": "measured vs projection",
        "model": str(args.model or "synthetic qwen3_moe 8x64 experts"), "tokens": args.tokens,
        "trials": args.trials, "context_tokens": context, "fit_row": args.fit,
        "slots": data["slots"], "mem_bandwidth_gbps": data["mem_gbps"], "disk_record_gbps": data["disk_gbps"],
        **results, "samples": {"gflops": data["gflops"], "page_cache_gbps": data["hot_gbps"],
                               "direct_gbps": data["direct_gbps"], "passes_tok_s": data["passes"]},
    }))


if __name__ == "__main__":
    main()
