"""Loader throughput by I/O thread count (`--threads`), cold page cache, buffered and direct reads.

Physics: each expert read is one pread of ~1.8 MB into a cache slab. More threads keep more reads in
flight (an SSD serves a queue of them faster than one at a time); on a 2-core machine they also take
turns on the GIL for their bookkeeping. The question is whether some count other than the default (4)
reads faster outside the noise. Every trial runs every thread count once, in a fresh order, on the same
store with the page cache dropped first; an A/A control (the default count twice, "4" and "4'") gives the
noise. Ratios are per trial against the same trial's "4".

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_loader import _drop, loader_gbps  # noqa: E402
from bench.synthetic_checkpoint import write_expert_checkpoint  # noqa: E402
from storage import ExpertKey, ExpertStore, LoaderConfig  # noqa: E402
from storage.packer import convert  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2,4,8", help="comma list of I/O thread counts")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-hidden", type=int, default=512, help="512 gives 1.77 MB experts")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--io", default="buffered,direct", help="comma list of I/O modes")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the test files (default: a temp dir)")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    variants = [str(t) for t in counts] + ["4'"]  # the A/A control: the default again
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        raw = write_expert_checkpoint(Path(tmp) / "raw", n_experts=args.experts, hidden=args.hidden,
                                      expert_hidden=args.expert_hidden)
        packed = convert(raw, Path(tmp) / "packed")
        rng, order_rng = np.random.default_rng(0), random.Random(0)
        gbps = {io: {v: [] for v in variants} for io in args.io.split(",")}
        for io in gbps:
            store = ExpertStore.open(packed, io_mode=io)
            files = sorted({r.path for e in range(args.experts) for r in store.ranges(ExpertKey(store.moe_layers[0], e))})
            for _ in range(args.trials):
                for v in order_rng.sample(variants, len(variants)):
                    _drop(files)
                    cfg = LoaderConfig(threads=int(v.rstrip("'")), io_mode=io)
                    gbps[io][v].append(loader_gbps(store, cfg, rng.permutation(args.experts).tolist()))
            store.close()
        expert_mb = ExpertStore.open(packed).layout(0).expert_bytes / 1e6

    results = {}
    print(f"cold-cache reads of {args.experts} experts x {expert_mb:.2f} MB (packed store), random order; "
          f"{args.trials} interleaved trials (every thread count once per trial, fresh order); GB/s: median "
          f"[min-max]; vs 4: median [min-max] of per-trial ratios to the same trial's 4 threads; 4' is the A/A control")
    print(f"{'io':<10}{'threads':>8}{'GB/s':>24}{'vs 4':>24}")
    for io, rows in gbps.items():
        results[io] = {}
        for v in variants:
            r = [a / b for a, b in zip(rows[v], rows["4"])]
            results[io][v] = {"gbps": rows[v], "ratio_vs_4": r}
            g = rows[v]
            print(f"{io:<10}{v:>8}{f'{statistics.median(g):.2f} [{min(g):.2f}-{max(g):.2f}]':>24}"
                  f"{f'{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]':>24}")
    print(json.dumps({"bench": "loader_threads", "expert_mb": expert_mb, "experts": args.experts,
                      "trials": args.trials, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                      "results": results}))


if __name__ == "__main__":
    main()
