"""Read less: cache policies against LRU and Belady's MIN, and the router lookahead (issue 15).

1-3. Replays (bench/readless_replay.py): policies and frequency oracles on bench/results/embedded.smtrace;
   a decoded workload with the lookahead's forecasts recorded, replayed with prefetch over a grid of
   settings; recall by distance beside spmoe's on verify windows.
4. Live plain decode at 25%, lookahead off and on interleaved, on the target packed (one read per expert),
   with real reads and with 1 ms added to every expert read (EMULATED): tok/s median (min-max) over repeats, host syncs per token, demand
   misses, prefetch used and wasted, MB read per token. "off" runs the default path (one-sync device
   passes); "off, per-layer" the per-layer synced path the lookahead rides on.

Usage: python -m bench.bench_readless [--repeats 3] [--tokens 48] [--skip-live] [--skip-replay]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script (bench/run_all.sh)

from bench.readless_replay import (
    ROOT,
    part_lookahead,
    part_recall_vs_spmoe,
    part_trace,
    spread,
)
from runtime.checkpoints import embedded_pair
from runtime.decode import OffloadConfig, OffloadedModel, generate_tokens


def _decode(om, prompts, tokens, one_sync):
    """Decode-only figures (GenerationStats leaves prefill out): tok/s median over prompts, sums per token."""
    tps, agg = [], {"tokens": 0, "misses": 0.0, "mb": 0.0}
    d = {"prefetch_hits": 0.0, "prefetch_loaded": 0.0, "prefetch_wasted": 0.0, "syncs": 0.0, "repairs": 0.0}
    for p in prompts:
        _, st = generate_tokens(om.model, list(om.tokenizer.encode(p)), max_tokens=tokens, om=om, one_sync=one_sync)
        n = st.n_tokens - 1
        tps.append(st.tokens_per_s)
        agg["tokens"] += n
        agg["misses"] += st.misses_per_token * n
        agg["mb"] += st.mb_read_per_token * n
        d["prefetch_hits"] += st.prefetch_used_per_token * n
        d["prefetch_loaded"] += st.prefetch_reads_per_token * n
        d["prefetch_wasted"] += st.prefetch_wasted_per_token * n
        d["syncs"] += st.host_syncs_per_token * n
        d["repairs"] += st.repairs_per_token * n
    return statistics.median(tps), agg, d


# label -> (lookahead (j, m, min_prob; None: the default 3/E; in_pass; in_repairs) or None, one_sync). "one-sync":
# the default path (device passes); a prefetching lookahead keeps its source layers' synced calls there, an in-pass
# one is folded into the pass (no prefetch; with in_repairs a repair also reads its forecasts). "per-layer":
# --one-sync off, every layer synced (where prefetch overlaps the next layer's reads).
LIVE_VARIANTS = {"off, one-sync": (None, "auto"), "off, per-layer": (None, "off"), "off, LRU, per-layer": (None, "off"),
                 "j=1 m=4 in-pass, one-sync": ((1, 4, None, True, False), "auto"),
                 "j=1 m=4 in-pass+repairs, one-sync": ((1, 4, None, True, True), "auto"),
                 "j=1 m=4 p>=3/E, one-sync": ((1, 4, None, False, False), "auto"),
                 "j=1 m=4 p>=3/E, per-layer": ((1, 4, None, False, False), "off"),
                 "j=1 m=4 p>=0, per-layer": ((1, 4, 0.0, False, False), "off"),
                 "j=2 m=4 p>=3/E, per-layer": ((2, 4, None, False, False), "off")}


def packed_target(tmp: str) -> Path:
    """The embedded target as a packed store: one positioned read per expert, so an emulated delay per read
    (storage/faults.py's slow) is a delay per expert. The raw checkpoint reads an expert tensor by tensor (nine
    reads for a 4-bit SwitchGLU): the same delay there would cost each expert nine times over."""
    from storage.packer import convert

    return convert(embedded_pair().target, Path(tmp) / "target")


def part_live(repeats: int, tokens: int, emulate: list[float]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return _part_live(packed_target(tmp), repeats, tokens, emulate)


def _part_live(target: Path, repeats: int, tokens: int, emulate: list[float]) -> dict:
    prompts = [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()][:2]
    out = {}
    for ms in emulate:
        runs = {v: [] for v in LIVE_VARIANTS}
        extra = {v: [] for v in LIVE_VARIANTS}
        for _ in range(repeats):
            for variant, (la, one_sync) in LIVE_VARIANTS.items():  # interleaved
                om = OffloadedModel.load(target, OffloadConfig(
                    budget="25%", inject=f"slow:ms={ms}" if ms else "", policy="lru" if "LRU" in variant else "dlfu"))
                try:
                    if la is not None:
                        om.set_lookahead(la[0], la[1], min_prob=la[2], in_pass=la[3]).in_repairs = la[4]
                    tps, agg, d = _decode(om, prompts, tokens, one_sync)
                finally:
                    om.close()
                runs[variant].append(tps)
                extra[variant].append({"misses_per_token": agg["misses"] / agg["tokens"],
                                       "mb_per_token": agg["mb"] / agg["tokens"],
                                       **{k: v / agg["tokens"] for k, v in d.items()}})
        label = f"EMULATED +{ms:g} ms per expert read" if ms else "real reads"
        lru = statistics.median(x["misses_per_token"] for x in extra["off, LRU, per-layer"])
        print(f"\nlive plain decode at 25% (dlfu unless LRU; packed store), {label}: decode tok/s median (min-max) over {repeats} interleaved "
              f"repeats of {len(prompts)} prompts x {tokens} tokens; ratio per repeat to off on the same path")
        for v in LIVE_VARIANTS:
            e = extra[v]
            med = lambda key: statistics.median(x[key] for x in e)  # noqa: E731
            base = "off, per-layer" if v.endswith("per-layer") else "off, one-sync"
            ratio = [a / b for a, b in zip(runs[v], runs[base])]
            print(f"  lookahead {v:<35}{spread(runs[v]):>22} tok/s  vs off {spread(ratio):>18} | syncs/tok "
                  f"{med('syncs'):.2f} (repairs {med('repairs'):.2f}) | demand misses/tok "
                  f"{med('misses_per_token'):.2f} ({med('misses_per_token') / lru:.2f}x LRU) | MB/tok {med('mb_per_token'):.4f} | prefetch reads/tok "
                  f"{med('prefetch_loaded'):.2f}: used {med('prefetch_hits'):.2f}, wasted {med('prefetch_wasted'):.2f}")
        out[label] = {"tok_s": runs, "detail": extra}
    return out


SPEC_VARIANTS = {"L=0": (0, 0), "L=0 + lookahead j=1": (0, 1), "L=3 spmoe": (3, 0), "L=3 spmoe + lookahead j=1": (3, 1)}


def part_spec(repeats: int, tokens: int, emulate: list[float]) -> dict:
    """Speculative decoding (routing-trained drafter, K=3, 25%): spmoe prefetch for the first L layers while
    the drafter runs, and the lookahead for the layers past L during verify."""
    with tempfile.TemporaryDirectory() as tmp:
        return _part_spec(packed_target(tmp), repeats, tokens, emulate)


def _part_spec(target: Path, repeats: int, tokens: int, emulate: list[float]) -> dict:
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
                    om = OffloadedModel.load(target, OffloadConfig(budget="25%", inject=f"slow:ms={ms}" if ms else ""))
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
        label = f"EMULATED +{ms:g} ms per expert read" if ms else "real reads"
        print(f"\nspeculative decoding at 25% (K=3; packed store), {label}: decode tok/s median (min-max) over {repeats} interleaved "
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
