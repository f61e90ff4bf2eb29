"""Cache policies on checkpoints without routing locality: LRU, LFU and dlfu misses per token.

Random-weight checkpoints, one per --seeds value and --models kind:
- synthetic: bench/decode_models.py's shape (qwen3_moe, 12 layers x 64 experts, top-4; seed 0 is its own);
- fullscale: the full-scale writer's qwen3-30b-a3b (bench/fullscale_checkpoint.py, --locality 0, --skew 0) at toy
  widths (--small) with 64 experts per layer instead of --small's 16 (top-8 needs more than 16 x 25%), 12 layers.
Each greedily decodes each bench prompt for --tokens tokens with the routing trace on (what `specmoe profile
--trace` records); each (checkpoint, prompt) trace is
replayed through the live cache's SlotTable at each --fractions cache size, plain decode (window 1), next to the
embedded pair's recorded trace (bench/results/embedded.smtrace) at the same sizes. dlfu-no-guard is dlfu
without its shadow-LRU guard (runtime/cache/decayed_lfu.py), for the before/after.
Rows: misses per token over all traces, and the per-trace ratio to LRU, median (min-max over traces).
Misses are counted by replay, so they do not depend on machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from unittest import mock

from runtime.cache.decayed_lfu import DecayedLFUPolicy
from runtime.cache.policy import POLICIES as REGISTRY
from runtime.checkpoints import make_tiny
from runtime.decode import OffloadConfig, OffloadedModel
from runtime.observe import RoutingTrace, trace_of
from runtime.tune import replay, run_workload

ROOT = Path(__file__).resolve().parent
POLICIES = ("lru", "lfu", "dlfu", "dlfu-no-guard")


class UnguardedDLFU(DecayedLFUPolicy):
    """dlfu without its shadow-LRU guard (the shadow never looks better): the policy before the guard."""

    def _shadow_use(self, e: int) -> None:
        self._lru_misses += 1.0


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def synthetic(scratch: Path, seed: int) -> Path:
    """bench/decode_models.py's synthetic checkpoint, with its weights drawn from `seed`."""
    return make_tiny(scratch / f"synthetic-{seed}", "qwen3_moe", seed=seed, layers=12, n_experts=64, top_k=4,
                     hidden=384, expert_hidden=256)


def fullscale(scratch: Path, seed: int) -> Path:
    """The full-scale writer's qwen3-30b-a3b, 12 layers at toy widths with 64 experts, no locality, no skew."""
    import bench.fullscale_checkpoint as fc

    out = scratch / f"fullscale-{seed}"
    with mock.patch.dict(fc.SMALL_DIMS, {"num_experts": 64}):
        fc.write_checkpoint(out, "qwen3-30b-a3b", layers=12, small=True, locality=0.0, skew=0.0, seed=seed)
    return out


MODELS = {"synthetic": (synthetic, "random-weight qwen3_moe, 12 layers x 64 experts top-4"),
          "fullscale": (fullscale, "full-scale writer's qwen3-30b-a3b at toy widths, 12 layers x 64 experts top-8, "
                                   "locality 0")}


def record(model: Path, prompts: list[str], tokens: int) -> list[RoutingTrace]:
    """One routing trace per prompt (prompt tokens and greedy tokens)."""
    out = []
    om = OffloadedModel.load(model, OffloadConfig(budget="100%", trace=True))
    try:
        for p in prompts:
            om.telemetry.new_sequence()
            run_workload(om, [p], max_tokens=tokens)
            tr = trace_of(om)
            out.append(RoutingTrace(tr.model, [tr.sequences[-1]]))
    finally:
        om.close()
    return out


def misses(trace: RoutingTrace, fraction: float) -> dict:
    """Misses per token of each policy over all MoE layers of `trace`."""
    n = trace.n_experts
    slots = int(round(fraction * n))
    tot = dict.fromkeys(POLICIES, 0)
    with mock.patch.dict(REGISTRY, {"dlfu-no-guard": UnguardedDLFU}):
        for i in range(len(trace.moe_layers)):
            seqs = [s for s in trace.layer(i) if len(s)]
            for p in POLICIES:
                tot[p] += replay(seqs, n, slots, p, 1).misses
    return {p: v / trace.n_tokens for p, v in tot.items()}


def table(name: str, traces: list[RoutingTrace], fractions: list[float]) -> dict:
    res = {}
    toks = sum(t.n_tokens for t in traces)
    for f in fractions:
        per = [misses(t, f) for t in traces]
        w = [t.n_tokens for t in traces]
        tot = {p: sum(r[p] * n for r, n in zip(per, w)) / toks for p in POLICIES}
        ratio = {p: [r[p] / r["lru"] for r in per] for p in POLICIES}
        print(f"{name} at {f:.0%}: misses/token (all traces), vs LRU per trace median (min-max over {len(per)})")
        for p in POLICIES:
            r = ratio[p]
            print(f"  {p:<14}{tot[p]:>8.2f}   {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")
        res[f"{f:g}"] = {"per_token": tot, "vs_lru": ratio}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300, help="greedy tokens per prompt")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated weight seeds of the random checkpoints")
    ap.add_argument("--models", default="synthetic,fullscale", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--fractions", default="0.25,0.5", help="comma-separated cache sizes, fractions of the experts")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    l0, t0 = loadavg(), time.time()
    prompts = [t for t in (ROOT / "prompts.txt").read_text().splitlines() if t.strip()]
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models {bad[0]!r}; expected a comma-separated list of {', '.join(MODELS)}")
    traces = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            traces[m] = [t for s in seeds for t in record(MODELS[m][0](Path(tmp), s), prompts, args.tokens)]
    print(f"# python bench/bench_policy_no_locality.py --tokens {args.tokens} --seeds {args.seeds} --models "
          f"{args.models} --fractions {args.fractions} | {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} | load "
          f"average before {l0}, after {loadavg()} | at nice 19 (misses do not depend on load) | "
          f"wall {time.time() - t0:.0f} s")
    out = {}
    for m in models:
        print(f"{m}: {MODELS[m][1]}, seeds {args.seeds}: {len(traces[m])} traces ({len(seeds)} checkpoints x "
              f"{len(prompts)} prompts), {sum(t.n_tokens for t in traces[m])} tokens")
        out[m] = table(m, traces[m], fractions)
    emb = RoutingTrace.load(ROOT / "results" / "embedded.smtrace")
    out["embedded"] = table(f"embedded.smtrace ({emb.n_tokens} tokens, {len(emb.sequences)} passages)", [emb],
                            fractions)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
