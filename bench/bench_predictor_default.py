"""What fitting a drafter->target projection on first use would cost at load, against what it buys.

Physics: spmoe needs, for a drafter of another width, a per-layer projection fitted on calibration
tokens run teacher-forced through both models (runtime/tune/calibrate.py). With the target's experts
paged from disk, each 256-token chunk routes nearly every expert of every MoE layer, so the fit reads
about the whole checkpoint per chunk before the first token is decoded; at least two chunks are needed
(one held out for the quality check). What it buys is the spmoe forecast -- only while the drafter
is accepted (a rejected drafter stops drafting, and no forecast is made).

Rows: a pair, the calibration tokens, the fit's wall time, the bytes it read (and as a share of all
expert bytes, per chunk), the held-out quality (R^2, router agreement; beside no projection's where
widths match) and whether calibrate's check would refuse it as worse than none. The mid-size pair has
the qwen3-30b-a3b preset's real widths cut to a few layers (bench/fullscale_checkpoint.py) and a
width-1024 random drafter; "at 48 layers" scales its bytes to the full model, read at --bandwidth.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.random_drafter import write_random_drafter  # noqa: E402
from runtime.checkpoints import embedded_pair  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel, load_drafter  # noqa: E402
from runtime.tune.calibrate import calibrate  # noqa: E402

CALIBRATION = Path(__file__).resolve().parent.parent / "runtime" / "data" / "calibration.txt"


def fit(name: str, target: Path, draft: Path, tokens: int, args, full_layers: int | None = None) -> dict:
    om = OffloadedModel.load(target, OffloadConfig(budget=args.budget, io_mode=args.io_mode))
    try:
        dmodel, dconfig = load_drafter(draft, om)
        expert_bytes = om.store.expert_bytes_total
        b0, t0 = om.counters()["bytes_read"], time.perf_counter()
        _, report = calibrate(om, dmodel, dconfig, CALIBRATION.read_text(), max_tokens=tokens)
        seconds, read = time.perf_counter() - t0, om.counters()["bytes_read"] - b0
        chunks = report.n_tokens // 256
        base = report.baseline_agreement
        row = {"pair": name, "tokens": report.n_tokens, "seconds": seconds, "bytes_read": read,
               "share_per_chunk": read / max(1, chunks) / expert_bytes, "expert_bytes": expert_bytes,
               "r2_mean": sum(report.r2.values()) / len(report.r2),
               "agreement": sum(report.agreement.values()) / len(report.agreement),
               "agreement_none": sum(base.values()) / len(base) if base else None,
               "refused": report.worse_than_none()}
        if full_layers:  # the same reads at the full model's depth, at the given bandwidth
            row["full_read_s"] = read * full_layers / len(om.moe_layers) / (args.bandwidth * 1e9)
        return row
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mid", type=Path, default=None, help="the mid-size checkpoint (bench/fullscale_checkpoint.py "
                    "--preset qwen3-30b-a3b --layers 4); default: written to a temporary directory")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--tokens", default="512,2048", help="calibration token counts (512: calibrate's minimum)")
    ap.add_argument("--bandwidth", type=float, default=2.0, help="GB/s for the 48-layer read time (an M4's SSD: ~2)")
    ap.add_argument("--io-mode", default="direct", choices=["buffered", "direct"])
    args = ap.parse_args()
    load0, t0 = os.getloadavg(), time.time()
    rows = []
    pair = embedded_pair()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        d64 = write_random_drafter(tmp / "d64", pair.target, hidden=64, layers=4, seed=3)
        for n in [int(x) for x in args.tokens.split(",")]:
            rows.append(fit("embedded + trained drafter (same width)", pair.target, pair.drafter_routed or pair.drafter,
                            n, args))
            rows.append(fit("embedded + random drafter (width 64)", pair.target, d64, n, args))
        mid = args.mid
        if mid is None:
            from bench.fullscale_checkpoint import main as write_checkpoint

            mid = tmp / "q30l4"
            write_checkpoint(["--preset", "qwen3-30b-a3b", "--layers", "4", "--out", str(mid)])
        d1024 = write_random_drafter(tmp / "d1024", mid, hidden=1024, layers=3, seed=3)
        rows.append(fit("mid-size 30B-A3B widths + random drafter (width 1024)", mid, d1024, 512, args, full_layers=48))
    load1 = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} | load average before {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} | wall {time.time() - t0:.0f} s")
    print(f"budget {args.budget}, io={args.io_mode}; read/chunk: bytes read per 256-token chunk over all expert bytes")
    print(f"{'pair':54} {'tokens':>6} {'fit s':>7} {'MB read':>8} {'read/chunk':>10} {'R^2':>6} {'agree':>6} "
          f"{'none':>6}  refused / at 48 layers")
    for r in rows:
        none = "-" if r["agreement_none"] is None else f"{r['agreement_none']:.0%}"
        tail = r["refused"] or "no"
        if "full_read_s" in r:
            tail += f" / {r['full_read_s']:.0f} s of reads at {args.bandwidth:g} GB/s"
        print(f"{r['pair']:54} {r['tokens']:6d} {r['seconds']:7.1f} {r['bytes_read'] / 1e6:8.0f} "
              f"{r['share_per_chunk']:10.0%} {r['r2_mean']:6.2f} {r['agreement']:6.0%} {none:>6}  {tail}")
    print(json.dumps({"bench": "predictor_default", "budget": args.budget, "load_avg": [load0, load1], "rows": rows}))


if __name__ == "__main__":
    main()
