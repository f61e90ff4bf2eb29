"""Read less: cache policies against LRU and Belady's MIN, and the router lookahead (issue 15).

1. Policies on bench/results/embedded.smtrace (the README's cache table: 40 passages, 21k tokens),
   replayed through the live cache's SlotTable at 25% of the experts, plain decode (window 1) and
   verify windows of 4: LRU, LFU, dlfu (the default) and Belady's MIN.
2. The lookahead: the embedded target decodes the bench prompts (sampled, 100% budget) with a recorder
   keeping every layer's routing and the router-lookahead forecast 1, 2 and 4 MoE layers ahead; recall
   by distance; then LRU/LFU/dlfu/Belady and dlfu with the lookahead prefetching (several experts-per-
   token settings) replayed on that same trace (runtime/tune/forecast_replay.py).
3. Recall on verify windows: spmoe (drafter states, every layer) and the lookahead scoring the same windows.
4. Live plain decode at 25%, lookahead off and on interleaved, with real reads and with 1 ms added to
   every expert read (EMULATED): tok/s median (min-max) over repeats, demand misses, prefetch used and
   wasted, MB read per token.
Ratios in the replay tables are per MoE layer: median (min-max over layers).

Usage: python -m bench.bench_readless [--repeats 3] [--tokens 48] [--skip-live] [--skip-replay]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
import numpy as np

from runtime.checkpoints import embedded_pair
from runtime.decode import OffloadConfig, OffloadedModel, generate_tokens
from runtime.observe import RoutingTrace
from runtime.tune.forecast_replay import replay_prefetch
from runtime.tune.replay import belady, replay

ROOT = Path(__file__).resolve().parent
DISTANCES = (1, 2, 4)


class Recorder:
    """The LookaheadPrefetch hook interface, recording instead of prefetching: per call, the routing and,
    per (target layer, distance), the lookahead's top-8 experts and their router probabilities."""

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


TOP = 8


def record_decode(prompts: list[str], tokens: int, seed: int = 0):
    """Plain decoding of the embedded target (100% budget, sampled at temperature 0.8 so that texts do not
    loop) with a Recorder: per prompt, routing {layer: (T, k)} and forecasts {(layer, j): (T, 16)}."""
    from predictor.lookahead import RouterLookahead

    mx.random.seed(seed)
    om = OffloadedModel.load(embedded_pair().target, OffloadConfig(budget="100%", telemetry=False))
    try:
        rec = Recorder(RouterLookahead(om.routers(), DISTANCES, TOP))
        for m in om.modules.values():
            m.lookahead = rec
        out = []
        for text in prompts:
            rec.actual, rec.forecast = {}, {}
            generate_tokens(om.model, list(om.tokenizer.encode(text))[:64], max_tokens=tokens, temp=0.8, om=om,
                            one_sync="off")
            out.append(({l: np.concatenate(v) for l, v in rec.actual.items()},
                        {k: np.concatenate(v) for k, v in rec.forecast.items()}))
        return out, om.moe_layers
    finally:
        om.close()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _policies(per_layer_seqs: dict, n: int, slots: int, w: int) -> dict:
    out = {}
    for l, seqs in per_layer_seqs.items():
        row = {p: replay(seqs, n, slots, p, w).misses for p in ("lru", "lfu", "dlfu")}
        row["belady"] = belady(seqs, slots, w).misses
        out[l] = row
    return out


def _print_policies(rows: dict, tokens: int, title: str) -> dict:
    tot = {p: sum(r[p] for r in rows.values()) / tokens for p in ("lru", "lfu", "dlfu", "belady")}
    print(f"\n{title}: misses (= reads) per token; ratios per layer, median (min-max over {len(rows)} layers)")
    print(f"{'policy':<34}{'demand/tok':>11}{'reads/tok':>10}{'demand vs LRU':>20}{'reads vs Belady':>20}")
    res = {"per_token": tot, "vs_lru": {}, "vs_belady": {}}
    for p in ("lru", "lfu", "dlfu", "belady"):
        v_lru = [r[p] / r["lru"] for r in rows.values()]
        v_opt = [r[p] / r["belady"] for r in rows.values()]
        res["vs_lru"][p], res["vs_belady"][p] = v_lru, v_opt
        print(f"{p:<34}{tot[p]:>11.2f}{tot[p]:>10.2f}{spread(v_lru):>20}{spread(v_opt):>20}")
    return res


def part_trace(fraction: float = 0.25) -> dict:
    """Policies on embedded.smtrace (the README's cache table), plain decode and verify windows of 4."""
    trace = RoutingTrace.load(ROOT / "results" / "embedded.smtrace")
    n, slots = trace.n_experts, int(round(fraction * trace.n_experts))
    out = {"tokens": trace.n_tokens, "slots": slots}
    print(f"== embedded.smtrace: {trace.n_tokens} tokens, {len(trace.sequences)} passages, {slots} slots per layer "
          f"({fraction:.0%} of {n} experts)")
    for w in (1, 4):
        rows = _policies({l: [s for s in trace.layer(i) if len(s)] for i, l in enumerate(trace.moe_layers)}, n, slots, w)
        out[w] = _print_policies(rows, trace.n_tokens, f"window {w} ({'plain decode' if w == 1 else 'verify windows'})")
    return out


def part_lookahead(tokens: int, fraction: float = 0.25, settings=((1, 2, 0.0), (1, 4, 0.0), (1, 4, 0.05),
                                                                  (2, 4, 0.0))) -> dict:
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
    rows = _policies(seqs, n, slots, 1)
    res = {"tokens": total, "recall_decode": recall, "policies": _print_policies(rows, total, "plain decode"),
           "lookahead": {}}
    for j, m, tau in settings:
        dem = reads = used = wasted = pref = 0
        d_lru, r_opt = [], []
        for l in layers:
            if (l, j) not in runs[0][1]:  # no layer this far before it: the cache alone
                r = rows[l]["dlfu"]
                dem, reads = dem + r, reads + r
                continue
            fcs = [np.where(f[(l, j)][:, TOP:TOP + m] >= tau, f[(l, j)][:, :m], -1).astype(np.int64) for _, f in runs]
            r = replay_prefetch(seqs[l], fcs, n, slots, "dlfu", 1)
            dem, reads, used, wasted, pref = dem + r.misses, reads + r.reads, used + r.prefetch_used, \
                wasted + r.prefetch_wasted, pref + r.prefetch_reads
            d_lru.append(r.misses / rows[l]["lru"])
            r_opt.append(r.reads / rows[l]["belady"])
        lru, opt = sum(r["lru"] for r in rows.values()), sum(r["belady"] for r in rows.values())
        label = f"dlfu + lookahead j={j} m={m}" + (f" p>={tau:g}" if tau else "")
        print(f"{label:<34}{dem / total:>11.2f}{reads / total:>10.2f}{spread(d_lru):>20}{spread(r_opt):>20}"
              f"   all layers: demand {dem / lru:.2f}x LRU, reads {reads / opt:.2f}x Belady; prefetch "
              f"{pref / total:.2f}/tok, used {used / total:.2f}, wasted {wasted / total:.2f}")
        res["lookahead"][label] = {"demand_per_token": dem / total, "reads_per_token": reads / total,
                                   "demand_vs_lru": dem / lru, "reads_vs_belady": reads / opt,
                                   "per_layer_demand_vs_lru": d_lru, "per_layer_reads_vs_belady": r_opt,
                                   "prefetch_per_token": pref / total, "used_per_token": used / total,
                                   "wasted_per_token": wasted / total}
    return res


def part_recall_vs_spmoe(tokens: int) -> dict:
    """Speculative decoding with spmoe forecasting every layer and the lookahead scoring (not prefetching)
    the same verify windows at distances 1, 2, 4."""
    from runtime.decode import release_drafter, speculative_decoder

    pair = embedded_pair()
    om = OffloadedModel.load(pair.target, OffloadConfig(budget="25%"))
    try:
        prompts = [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()]
        spmoe_hits = spmoe_actual = 0
        la = {j: [0, 0] for j in DISTANCES}
        for p in prompts:
            ids = list(om.tokenizer.encode(p))
            dec = speculative_decoder(om, pair.default_drafter, ids, max_tokens=tokens, num_draft=3, predictor="spmoe",
                                      cutoff=None)
            hook = om.set_lookahead(None, distances=DISTANCES, queue=False)
            try:
                dec.generate(ids, tokens)
            finally:
                release_drafter(dec.drafter)
            spmoe_hits += sum(s.hits for s in dec.stats.per_layer.values())
            spmoe_actual += sum(s.actual for s in dec.stats.per_layer.values())
            for j, s in hook.stats.by_distance.items():
                la[j][0] += s.hits
                la[j][1] += s.actual
        out = {"spmoe": spmoe_hits / spmoe_actual, **{f"lookahead_{j}": h / a if a else 0.0 for j, (h, a) in la.items()}}
        print(f"\n== recall on verify windows (K=3, {len(prompts)} prompts x {tokens} tokens, routing-trained drafter): "
              f"spmoe (drafter states, all layers) {out['spmoe']:.1%}; lookahead "
              + ", ".join(f"{j} ahead {out[f'lookahead_{j}']:.1%}" for j in DISTANCES))
        return out
    finally:
        om.set_lookahead(0)
        om.close()


def _decode(om, prompts, tokens):
    """Decode-only figures (GenerationStats leaves prefill out): tok/s median over prompts, sums per token."""
    tps, agg = [], {"tokens": 0, "misses": 0.0, "mb": 0.0}
    d = {"prefetch_hits": 0.0, "prefetch_loaded": 0.0, "prefetch_wasted": 0.0}
    for p in prompts:
        _, st = generate_tokens(om.model, list(om.tokenizer.encode(p)), max_tokens=tokens, om=om, one_sync="off")
        n = st.n_tokens - 1
        tps.append(st.tokens_per_s)
        agg["tokens"] += n
        agg["misses"] += st.misses_per_token * n
        agg["mb"] += st.mb_read_per_token * n
        d["prefetch_hits"] += st.prefetch_used_per_token * n
        d["prefetch_loaded"] += st.prefetch_reads_per_token * n
        d["prefetch_wasted"] += st.prefetch_wasted_per_token * n
    return statistics.median(tps), agg, d


LIVE_VARIANTS = {"off": None, "j=1 m=4": (1, 4, 0.0), "j=1 m=2": (1, 2, 0.0), "j=1 m=4 p>=0.05": (1, 4, 0.05),
                 "j=2 m=4": (2, 4, 0.0)}


def part_live(repeats: int, tokens: int, emulate: list[float]) -> dict:
    prompts = [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()][:2]
    out = {}
    for ms in emulate:
        runs = {v: [] for v in LIVE_VARIANTS}
        extra = {v: [] for v in LIVE_VARIANTS}
        for _ in range(repeats):
            for variant, la in LIVE_VARIANTS.items():  # interleaved
                om = OffloadedModel.load(embedded_pair().target, OffloadConfig(
                    budget="25%", inject=f"slow:ms={ms}" if ms else ""))
                try:
                    if la is not None:
                        om.set_lookahead(la[0], la[1], min_prob=la[2])
                    tps, agg, d = _decode(om, prompts, tokens)
                finally:
                    om.close()
                runs[variant].append(tps)
                extra[variant].append({"misses_per_token": agg["misses"] / agg["tokens"],
                                       "mb_per_token": agg["mb"] / agg["tokens"],
                                       **{k: v / agg["tokens"] for k, v in d.items()}})
        label = f"EMULATED +{ms:g} ms/read" if ms else "real reads"
        print(f"\nlive plain decode at 25% (dlfu), {label}: decode tok/s median (min-max) over {repeats} interleaved "
              f"repeats of {len(prompts)} prompts x {tokens} tokens; ratio to off per repeat")
        for v in LIVE_VARIANTS:
            e = extra[v]
            med = lambda key: statistics.median(x[key] for x in e)  # noqa: E731
            ratio = [a / b for a, b in zip(runs[v], runs["off"])]
            print(f"  lookahead {v:<16}{spread(runs[v]):>22} tok/s  on/off {spread(ratio):>18} | demand misses/tok "
                  f"{med('misses_per_token'):.2f} | MB/tok {med('mb_per_token'):.4f} | prefetch reads/tok "
                  f"{med('prefetch_loaded'):.2f}: used {med('prefetch_hits'):.2f}, wasted {med('prefetch_wasted'):.2f}")
        out[label] = {"tok_s": runs, "detail": extra}
    return out


SPEC_VARIANTS = {"L=0": (0, 0), "L=0 + lookahead j=1": (0, 1), "L=3 spmoe": (3, 0), "L=3 spmoe + lookahead j=1": (3, 1)}


def part_spec(repeats: int, tokens: int, emulate: list[float]) -> dict:
    """Speculative decoding (routing-trained drafter, K=3, 25%): spmoe prefetch for the first L layers while
    the drafter runs, and the lookahead for the layers past L during verify."""
    from runtime.decode import run_speculative

    pair = embedded_pair()
    prompts = [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()][:2]
    out = {}
    for ms in emulate:
        runs = {v: [] for v in SPEC_VARIANTS}
        extra = {v: [] for v in SPEC_VARIANTS}
        for _ in range(repeats):
            for v, (cutoff, j) in SPEC_VARIANTS.items():
                tps, miss, mb, n = [], 0, 0, 0
                for p in prompts:
                    om = OffloadedModel.load(pair.target, OffloadConfig(budget="25%", inject=f"slow:ms={ms}" if ms else ""))
                    try:
                        ids = list(om.tokenizer.encode(p))
                        _, st, _ = run_speculative(om, pair.default_drafter, ids, max_tokens=tokens, num_draft=3,
                                                   predictor="spmoe" if cutoff else "none", cutoff=cutoff, lookahead=j)
                    finally:
                        om.close()
                    tps.append(st.n_tokens / st.decode_s if st.decode_s else 0.0)
                    miss += st.counters["misses"]
                    mb += st.counters["bytes_read"]
                    n += st.n_tokens
                runs[v].append(statistics.median(tps))
                extra[v].append({"misses_per_token": miss / n, "mb_per_token": mb / 1e6 / n})
        label = f"EMULATED +{ms:g} ms/read" if ms else "real reads"
        print(f"\nspeculative decoding at 25% (K=3), {label}: decode tok/s median (min-max) over {repeats} interleaved "
              f"repeats of {len(prompts)} prompts x {tokens} tokens; ratio to L=0 per repeat")
        for v in SPEC_VARIANTS:
            ratio = [a / b for a, b in zip(runs[v], runs["L=0"])]
            med = lambda key: statistics.median(x[key] for x in extra[v])  # noqa: E731
            print(f"  {v:<28}{spread(runs[v]):>22} tok/s  vs L=0 {spread(ratio):>18} | demand misses/tok "
                  f"{med('misses_per_token'):.2f} | MB/tok {med('mb_per_token'):.4f}")
        out[label] = {"tok_s": runs, "detail": extra}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per prompt in the live runs")
    ap.add_argument("--record-tokens", type=int, default=200, help="tokens per prompt of the recorded decode workload")
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--spec", action="store_true", help="only the speculative comparison (spmoe + lookahead)")
    args = ap.parse_args()
    result = {}
    if args.spec:
        result["speculative"] = part_spec(args.repeats, args.tokens, [0.0, 1.0])
        print(json.dumps(result, default=lambda o: str(o)))
        return
    if not args.skip_replay:
        result["trace"] = part_trace()
        result["lookahead_replay"] = part_lookahead(args.record_tokens)
        result["recall_vs_spmoe"] = part_recall_vs_spmoe(args.tokens)
    if not args.skip_live:
        result["live"] = part_live(args.repeats, args.tokens, [0.0, 1.0])
    print(json.dumps(result, default=lambda o: str(o)))


if __name__ == "__main__":
    main()
