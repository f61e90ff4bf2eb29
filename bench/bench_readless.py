"""Read less: cache policies against LRU and Belady's MIN, and the router lookahead's forecasts, replayed.

1-2. Replays (bench/readless_replay.py): policies and frequency oracles on bench/results/embedded.smtrace;
   a decoded workload with the lookahead's forecasts recorded, replayed with prefetch over a grid of
   settings. (The live lookahead prefetcher and its speculative variant were measured slower or within the
   noise -- bench/results/readless_live.txt, readless_speculative.txt -- and taken out of the engine.)

Usage: python -m bench.bench_readless [--record-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script (bench/run_all.sh)

from bench.readless_replay import part_lookahead, part_trace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--record-tokens", type=int, default=200, help="tokens per prompt of the recorded decode workload")
    ap.add_argument("--skip-live", action="store_true", help="accepted for older run lines; nothing live is run")
    args = ap.parse_args()
    result = {"trace": part_trace(), "lookahead_replay": part_lookahead(args.record_tokens)}
    print(json.dumps(result, default=lambda o: str(o)))


if __name__ == "__main__":
    main()
