"""Loader throughput by read piece size (LoaderConfig.piece_bytes) on full-size checkpoints, direct I/O.

Physics: a decode step misses a few experts per layer and waits for all of them. Read as one piece per
expert, a layer that misses two 13 MB gpt-oss experts keeps two threads busy and the others idle; cut into
pieces, every I/O thread (and the waiting caller) reads a share. Smaller pieces spread the work wider but
cost a lock, a GIL hand-off and a system call each.

Each trial is one "layer": `--misses` random experts of a random MoE layer, submitted as the expert cache
does (the first with wake=False, the caller then waits on all), into buffers outside any cache. Every
variant runs once per trial in a fresh order; "none" reads each expert as one piece (every range in turn on
one thread); the default size runs twice (an A/A control) to give the noise. Ratios are per trial against
the same trial's "none".

Prints a table and ends with one JSON line.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig  # noqa: E402
from storage.loader import DEMAND  # noqa: E402


def _size(text: str) -> int | None:
    if text == "none":
        return None
    mult = {"k": 1 << 10, "m": 1 << 20}.get(text[-1].lower(), 1)
    return int(text.rstrip("kKmM")) * mult


def _layer_read(loader: AsyncLoader, keys: list[ExpertKey], bufs: list[list[np.ndarray]]) -> None:
    tickets = []
    for key, views in zip(keys, bufs):
        tickets.append(loader.submit(key, views, priority=DEMAND, wake=bool(tickets)))
    loader.wait_all(tickets)


def measure(model: Path, misses: int, variants: list[str], trials: int, seed: int) -> dict:
    """GB/s per variant over `trials` interleaved layer reads of `misses` experts."""
    store = ExpertStore.open(model, io_mode="direct")
    layers = store.moe_layers
    lay = store.layout(layers[0])
    bufs = [[np.empty(t.nbytes, np.uint8) for t in lay.tensors] for _ in range(misses)]
    nbytes = misses * lay.expert_bytes
    loaders = {v: AsyncLoader(store, LoaderConfig(io_mode="direct", piece_bytes=_size(v.rstrip("'")))) for v in variants}
    rng = random.Random(seed)
    gbps: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(trials):
        for v in rng.sample(variants, len(variants)):
            keys = [ExpertKey(rng.choice(layers), e) for e in rng.sample(range(lay.n_experts), misses)]
            t0 = time.perf_counter()
            _layer_read(loaders[v], keys, bufs)
            gbps[v].append(nbytes / (time.perf_counter() - t0) / 1e9)
    for loader in loaders.values():
        loader.close()
    store.close()
    return {"expert_mb": lay.expert_bytes / 1e6, "ranges_per_expert": len(store.ranges(ExpertKey(layers[0], 0))),
            "default_piece_bytes": LoaderConfig().piece_bytes, "gbps": gbps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, action="append", required=True, help="checkpoint directory (repeatable)")
    ap.add_argument("--misses", default="1,3", help="comma list: experts missed per layer read")
    ap.add_argument("--sizes", default="none,256k,512k,1m,2m", help="comma list of piece sizes (none: whole expert)")
    ap.add_argument("--trials", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    for s in sizes:
        try:
            _size(s)
        except ValueError:
            ap.error(f"--sizes: {s!r} is not a size; expected none or e.g. 512k, 1m")
    default = LoaderConfig().piece_bytes
    control = next((s for s in sizes if _size(s) == default), None)
    variants = sizes + ([control + "'"] if control else [])
    load_before = os.getloadavg()
    results = []
    print(f"direct reads of a layer's missed experts through AsyncLoader ({LoaderConfig().threads} I/O threads + the "
          f"waiting caller); {args.trials} interleaved trials; GB/s median [min-max]; vs none: median [min-max] of "
          f"per-trial ratios; a size marked ' is the default again (A/A control)")
    print(f"{'model':<28}{'misses':>7}{'piece':>8}{'GB/s':>20}{'vs none':>20}")
    for model in args.model:
        for misses in (int(m) for m in args.misses.split(",")):
            r = measure(model, misses, variants, args.trials, args.seed)
            base = r["gbps"]["none"] if "none" in r["gbps"] else None
            for v, g in r["gbps"].items():
                ratio = [a / b for a, b in zip(g, base)] if base else []
                rtxt = f"{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]" if ratio else "-"
                print(f"{model.name:<28}{misses:>7}{v:>8}"
                      f"{f'{statistics.median(g):.2f} [{min(g):.2f}-{max(g):.2f}]':>20}{rtxt:>20}")
            results.append({"model": model.name, "misses": misses, **r})
    print(json.dumps({"bench": "loader_pieces", "trials": args.trials, "load_avg_before": load_before,
                      "load_avg_after": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
