"""Replay parts of bench/bench_readless.py: cache policies, oracles and the lookahead on recorded traces.

- part_trace: LRU, LFU, dlfu and Belady's MIN on bench/results/embedded.smtrace (the README's cache table),
  plain decode (window 1) and verify windows of 4, plus the frequency oracles (window 1): eviction by each
  expert's *future* frequency, which no online policy knows, to show how much foresight 1.2x Belady needs.
- part_lookahead: the embedded target decodes the bench prompts with a Recorder keeping every layer's routing
  and the router-lookahead forecast 1, 2 and 4 MoE layers ahead (top-8 ids and probabilities); recall by
  distance; policies, oracles and the per-layer slot split on that trace; then dlfu with the lookahead
  prefetching, over a grid of experts per token m and router-probability thresholds p, and with prefetch
  admitted into free slots only (runtime/tune/forecast_replay.py).
The router lookahead is an analysis here only: as a live prefetcher it never paid (docs/flags.md), so it was taken out
of the engine; the Recorder wraps the MoE modules' calls in this process to record its forecasts.
Ratios are per MoE layer: median (min-max over layers).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import mlx.core as mx
import numpy as np

from runtime.checkpoints import embedded_pair
from runtime.decode import OffloadConfig, OffloadedModel, generate_tokens
from runtime.observe import RoutingTrace
from runtime.tune import allocate_slots, belady, coarse_miss_curve, future_frequency_misses, replay, replay_prefetch

ROOT = Path(__file__).resolve().parent
DISTANCES = (1, 2, 4)
TOP = 8
POLICIES = ("lru", "lfu", "dlfu", "belady")
ORACLES = {"oracle: passage frequency": None, "oracle: next 8 tokens' frequency": 8,
           "oracle: next 32 tokens' frequency": 32}
DEFAULT_P = 3 / 64  # the lookahead's default threshold for 64 experts (predictor.lookahead.DEFAULT_SHARE / E)
# (j, m, p, admit): MoE layers ahead, experts per token, minimum router probability, where prefetches may go
SETTINGS = ((1, 2, 0.0, "any"), (1, 4, 0.0, "any"), (1, 4, 0.0, "free"), (1, 4, 0.04, "any"), (1, 4, DEFAULT_P, "any"),
            (1, 4, 0.06, "any"), (1, 4, 0.08, "any"), (1, 8, DEFAULT_P, "any"), (2, 4, 0.0, "any"),
            (2, 4, DEFAULT_P, "any"))


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


class Recorder:
    """Per synced MoE call: the routing and, per (target layer, distance), the lookahead's top-8 experts and their
    router probabilities."""

    def __init__(self, lookahead):
        self.lookahead = lookahead
        self.actual: dict[int, list[np.ndarray]] = {}
        self.forecast: dict[tuple[int, int], list[np.ndarray]] = {}  # -> (T, 16): 8 ids then 8 probabilities

    def start(self, layer, x):
        out = []
        for hop, logits in self.lookahead.logits(layer, x):
            top = mx.argsort(-logits, axis=-1)[:, :TOP]
            out.append((hop, mx.concatenate([top.astype(mx.float32),
                                             mx.take_along_axis(mx.softmax(logits, axis=-1), top, axis=-1)], axis=-1)))
        return out

    def finish(self, layer, ahead, ids):
        self.actual.setdefault(layer, []).append(ids.reshape(-1, ids.shape[-1]))
        for hop, top in ahead:
            self.forecast.setdefault((hop.target, hop.distance), []).append(np.array(top))


def record_decode(prompts: list[str], tokens: int, seed: int = 0):
    """Plain decoding of the embedded target (100% budget, sampled at temperature 0.8 so that texts do not
    loop) with a Recorder: per prompt, routing {layer: (T, k)} and forecasts {(layer, j): (T, 16)}."""
    from predictor.lookahead import RouterLookahead

    mx.random.seed(seed)
    om = OffloadedModel.load(embedded_pair().target, OffloadConfig(budget="100%", telemetry=False))
    try:
        from runtime.cache import CachedSwitchGLU

        rec = Recorder(RouterLookahead(om.routers(), DISTANCES, TOP))
        real = CachedSwitchGLU.__call__

        def call(module, x, indices):  # the per-layer synced path: record, then the module's own call
            ahead = rec.start(module.layer, x)
            mx.eval(indices, [top for _, top in ahead])
            rec.finish(module.layer, ahead, np.array(indices))
            return real(module, x, indices)

        CachedSwitchGLU.__call__ = call
        out = []
        for text in prompts:
            rec.actual, rec.forecast = {}, {}
            generate_tokens(om.model, list(om.tokenizer.encode(text))[:64], max_tokens=tokens, temp=0.8, om=om,
                            one_sync="off")
            out.append(({l: np.concatenate(v) for l, v in rec.actual.items()},
                        {k: np.concatenate(v) for k, v in rec.forecast.items()}))
        return out, om.moe_layers
    finally:
        CachedSwitchGLU.__call__ = real
        om.close()


def _policies(per_layer_seqs: dict, n: int, slots: int, w: int, oracles: bool = False) -> dict:
    out = {}
    for l, seqs in per_layer_seqs.items():
        row = {p: replay(seqs, n, slots, p, w).misses for p in ("lru", "lfu", "dlfu")}
        row["belady"] = belady(seqs, slots, w).misses
        if oracles:
            row.update({name: future_frequency_misses(seqs, slots, h) for name, h in ORACLES.items()})
        out[l] = row
    return out


def _print_policies(rows: dict, tokens: int, title: str) -> dict:
    names = [p for p in list(POLICIES) + list(ORACLES) if p in next(iter(rows.values()))]
    tot = {p: sum(r[p] for r in rows.values()) / tokens for p in names}
    print(f"\n{title}: misses (= reads) per token; ratios per layer, median (min-max over {len(rows)} layers)")
    print(f"{'policy':<36}{'demand/tok':>11}{'reads/tok':>10}{'demand vs LRU':>20}{'reads vs Belady':>20}")
    res = {"per_token": tot, "vs_lru": {}, "vs_belady": {}}
    for p in names:
        v_lru = [r[p] / r["lru"] for r in rows.values()]
        v_opt = [r[p] / r["belady"] for r in rows.values()]
        res["vs_lru"][p], res["vs_belady"][p] = v_lru, v_opt
        print(f"{p:<36}{tot[p]:>11.2f}{tot[p]:>10.2f}{spread(v_lru):>20}{spread(v_opt):>20}")
    return res


def part_trace(fraction: float = 0.25) -> dict:
    """Policies on embedded.smtrace (the README's cache table), plain decode and verify windows of 4."""
    trace = RoutingTrace.load(ROOT / "results" / "embedded.smtrace")
    n, slots = trace.n_experts, int(round(fraction * trace.n_experts))
    out = {"tokens": trace.n_tokens, "slots": slots}
    print(f"== embedded.smtrace: {trace.n_tokens} tokens, {len(trace.sequences)} passages, {slots} slots per layer "
          f"({fraction:.0%} of {n} experts)")
    for w in (1, 4):
        rows = _policies({l: [s for s in trace.layer(i) if len(s)] for i, l in enumerate(trace.moe_layers)}, n, slots,
                         w, oracles=w == 1)
        out[w] = _print_policies(rows, trace.n_tokens, f"window {w} ({'plain decode' if w == 1 else 'verify windows'})")
    return out


def _split(seqs: dict, n: int, slots: int, tokens: int) -> dict:
    """dlfu with the same total slots split over layers by each layer's dlfu miss curve on this very trace
    (an upper bound on what a split from another trace of the model gives)."""
    lo = slots // 2
    curves = {l: coarse_miss_curve(s, n, lo, 1, "dlfu", points=12) for l, s in seqs.items()}
    alloc = allocate_slots(curves, slots * len(seqs), lo)
    equal = sum(replay(s, n, slots, "dlfu").misses for s in seqs.values()) / tokens
    split = sum(replay(s, n, alloc[l], "dlfu").misses for l, s in seqs.items()) / tokens
    print(f"per-layer slot split by dlfu miss curves (same {slots * len(seqs)} slots): {sorted(alloc.items())}; "
          f"dlfu misses/token {equal:.2f} equal -> {split:.2f} split ({split / equal:.2f}x)")
    return {"alloc": alloc, "equal_per_token": equal, "split_per_token": split}


def _per_prompt(runs, layers, n: int, slots: int, j: int, m: int, tau: float) -> dict:
    """Per prompt, all layers summed: demand misses with the lookahead vs LRU's, reads vs Belady's."""
    demand, reads = [], []
    for a, f in runs:
        dem = rd = lru = opt = 0
        for l in layers:
            seq = [a[l]]
            lru += replay(seq, n, slots, "lru").misses
            opt += belady(seq, slots).misses
            fc = [np.where(f[(l, j)][:, TOP:TOP + m] >= tau, f[(l, j)][:, :m], -1).astype(np.int64)] \
                if (l, j) in f else None
            r = replay_prefetch(seq, fc, n, slots, "dlfu", 1)
            dem, rd = dem + r.misses, rd + r.reads
        demand.append(dem / lru)
        reads.append(rd / opt)
    return {"demand_vs_lru": demand, "reads_vs_belady": reads}


def part_lookahead(tokens: int, fraction: float = 0.25) -> dict:
    prompts = [t for t in (ROOT / "profile_texts.txt").read_text().splitlines() if t.strip()]
    prompts += [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()]
    runs, layers = record_decode(prompts, tokens)
    n, slots = 64, int(round(fraction * 64))
    total = sum(len(a[layers[0]]) for a, _ in runs)
    print(f"\n== decoded workload: {len(prompts)} prompts x {tokens} sampled tokens = {total} tokens "
          f"(prompt tokens included), {slots} slots per layer")
    recall = {}
    for j in DISTANCES:
        hits = count = 0
        for a, f in runs:
            for l in layers:
                if (l, j) in f:
                    act, fc = a[l], f[(l, j)][:, :4].astype(np.int64)
                    hits += sum(len(np.intersect1d(x, y)) for x, y in zip(act, fc))
                    count += act.size
        recall[j] = hits / count if count else 0.0
    print("lookahead recall (top-4 forecast vs the token's top-4), single tokens: "
          + ", ".join(f"{j} layer(s) ahead {r:.1%}" for j, r in recall.items()))
    seqs = {l: [a[l] for a, _ in runs] for l in layers}
    rows = _policies(seqs, n, slots, 1, oracles=True)
    res = {"tokens": total, "recall_decode": recall, "policies": _print_policies(rows, total, "plain decode"),
           "split": _split(seqs, n, slots, total), "lookahead": {}}
    print(f"\ndlfu + lookahead prefetch (j: MoE layers ahead, m: experts per token, p: minimum router probability; "
          f"admit free: only into free slots); layer {layers[0]} has no forecast (the cache alone)")
    print(f"{'setting':<36}{'demand/tok':>11}{'reads/tok':>10}{'demand vs LRU':>20}{'reads vs Belady':>20}")
    for j, m, tau, admit in SETTINGS:
        dem = reads = used = wasted = pref = 0
        d_lru, r_opt = [], []
        for l in layers:
            if (l, j) not in runs[0][1]:  # no layer this far before it: the cache alone
                r = rows[l]["dlfu"]
                dem, reads = dem + r, reads + r
                continue
            fcs = [np.where(f[(l, j)][:, TOP:TOP + m] >= tau, f[(l, j)][:, :m], -1).astype(np.int64) for _, f in runs]
            r = replay_prefetch(seqs[l], fcs, n, slots, "dlfu", 1, admit=admit)
            dem, reads, used, wasted, pref = dem + r.misses, reads + r.reads, used + r.prefetch_used, \
                wasted + r.prefetch_wasted, pref + r.prefetch_reads
            d_lru.append(r.misses / rows[l]["lru"])
            r_opt.append(r.reads / rows[l]["belady"])
        lru, opt = sum(r["lru"] for r in rows.values()), sum(r["belady"] for r in rows.values())
        label = f"dlfu + lookahead j={j} m={m}" + (f" p>={tau:.3g}" if tau else "") + (" admit free" if admit == "free" else "")
        print(f"{label:<36}{dem / total:>11.2f}{reads / total:>10.2f}{spread(d_lru):>20}{spread(r_opt):>20}"
              f"   all layers: demand {dem / lru:.2f}x LRU, reads {reads / opt:.2f}x Belady; prefetch "
              f"{pref / total:.2f}/tok, used {used / total:.2f}, wasted {wasted / total:.2f}")
        res["lookahead"][label] = {"demand_per_token": dem / total, "reads_per_token": reads / total,
                                   "demand_vs_lru": dem / lru, "reads_vs_belady": reads / opt,
                                   "per_layer_demand_vs_lru": d_lru, "per_layer_reads_vs_belady": r_opt,
                                   "prefetch_per_token": pref / total, "used_per_token": used / total,
                                   "wasted_per_token": wasted / total}
    pp = _per_prompt(runs, layers, n, slots, 1, 4, DEFAULT_P)
    print(f"default (j=1 m=4 p>=3/E) per prompt, all layers, over {len(runs)} prompts: demand vs LRU "
          f"{spread(pp['demand_vs_lru'])}, reads vs Belady {spread(pp['reads_vs_belady'])}")
    res["per_prompt_default"] = pp
    return res
