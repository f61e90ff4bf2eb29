"""Telemetry overhead: decode tok/s with telemetry off, on (the default), and tracing.

Physics: telemetry does a little host work per MoE call (counting unique ids,
adding counters) on data the module already read back, so its cost should be a
small constant per layer per token, visible only on small models where a token
takes a few milliseconds. Measured on the same model in one run, interleaved.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode import decode_tps  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402

VARIANTS = {"off": dict(telemetry=False), "on (default)": dict(telemetry=True), "on + trace": dict(trace=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4,
                                       hidden=256, expert_hidden=256)
        models = {name: OffloadedModel.load(path, OffloadConfig(budget=args.budget, **kw)) for name, kw in VARIANTS.items()}
        for om in models.values():
            decode_tps(om.model, om.tokenizer, 8, om)
        samples = {name: [] for name in VARIANTS}
        cpu = {name: [] for name in VARIANTS}  # this process's CPU ms per decoded token: less moved by other tenants
        order = random.Random(0)
        load0 = os.getloadavg()
        for _ in range(args.trials):
            for name in order.sample(list(models), len(models)):  # a fresh order each trial
                om = models[name]
                tps, per = decode_tps(om.model, om.tokenizer, args.tokens, om)
                samples[name].append(tps)
                cpu[name].append(per["cpu_ms_per_token"])
        load1 = os.getloadavg()
        for om in models.values():
            om.close()
    print(f"decode tok/s at budget {args.budget}, median of {args.trials} interleaved trials; vs off: median [min-max] "
          "of per-trial ratios (each trial runs every variant back to back, in a fresh order); CPU vs off: off's CPU "
          f"ms/token over the variant's, per trial; load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'telemetry':<16}{'tok/s':>9}{'min-max':>15}{'vs off [min-max]':>24}  {'verdict':<17}"
          f"{'CPU ms/tok':>10}{'CPU vs off [min-max]':>24}  CPU verdict")
    results = {}
    for name in VARIANTS:
        tps = statistics.median(samples[name])
        ratios = [a / b for a, b in zip(samples[name], samples["off"])]
        verdict = ("-" if name == "off" else "within the noise" if min(ratios) <= 1 <= max(ratios)
                   else "slower" if max(ratios) < 1 else "faster")
        cratios = [b / a for a, b in zip(cpu[name], cpu["off"])]
        cverdict = ("-" if name == "off" else "within the noise" if min(cratios) <= 1 <= max(cratios)
                    else "slower" if max(cratios) < 1 else "faster")
        results[name] = {"tokens_per_s": tps, "tokens_per_s_min": min(samples[name]),
                         "tokens_per_s_max": max(samples[name]), "ratio_vs_off": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios), "verdict": verdict,
                         "cpu_ms_per_token": statistics.median(cpu[name]), "cpu_ratio_vs_off": statistics.median(cratios),
                         "cpu_ratio_min": min(cratios), "cpu_ratio_max": max(cratios), "cpu_verdict": cverdict}
        print(f"{name:<16}{tps:>9.1f}{f'{min(samples[name]):.1f}-{max(samples[name]):.1f}':>15}"
              f"{f'{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]':>24}  {verdict:<17}"
              f"{statistics.median(cpu[name]):>10.2f}"
              f"{f'{statistics.median(cratios):.3f} [{min(cratios):.3f}-{max(cratios):.3f}]':>24}  {cverdict}")
    print(json.dumps({"bench": "telemetry", "budget": args.budget, "trials": args.trials, "load_avg": [load0, load1],
                      "results": results}))


if __name__ == "__main__":
    main()
