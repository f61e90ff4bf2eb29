"""Plot bench_batch.py's result: concurrent streams against aggregate tok/s, batched and one at a time.

Reads the last line (the JSON record) of a bench/bench_batch.py output file and draws one panel per
budget: the median aggregate tok/s of the queue and of the batch for each number of streams, with
min-max bars. Prints what it wrote and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path, help="a bench/bench_batch.py output file (its last line is the JSON record)")
    ap.add_argument("--plot", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args()
    lines = args.result.read_text().strip().splitlines()
    record = json.loads(lines[-1])
    if record.get("bench") != "batch":
        raise SystemExit(f"{args.result}: last line is not bench_batch.py's JSON record")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(dict.fromkeys(r["budget"] for r in record["rows"]))
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.4), sharey=True, squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        rows = [r for r in record["rows"] if r["budget"] == budget]
        streams = [r["streams"] for r in rows]
        for way, style in (("queue", "o--"), ("batch", "s-")):
            values = [[x["aggregate_tps"] for x in r[way]] for r in rows]
            med = [statistics.median(v) for v in values]
            low = [m - min(v) for m, v in zip(med, values)]
            high = [max(v) - m for m, v in zip(med, values)]
            ax.errorbar(streams, med, yerr=[low, high], fmt=style, capsize=3,
                        label="one at a time" if way == "queue" else "batched")
        ax.set_title(f"budget {budget}")
        ax.set_xlabel("concurrent streams")
        ax.set_xticks(streams)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("aggregate tok/s (median, min-max)")
    axes[0][0].legend()
    fig.suptitle(f"embedded target, {record['max_tokens']} tokens per stream, {record['repeats']} repeats")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot} from {args.result}")
    print(json.dumps({"bench": "plot_batch", "result": str(args.result), "plot": str(args.plot)}))


if __name__ == "__main__":
    main()
