"""The profile plot: overlap vs distance per layer group, unique experts vs window size.

matplotlib is an optional extra (`pip install specmoe[plot]`); importing this
module without it raises a ValueError that says so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'specmoe[plot]'") from None
    return plt


def plot_profile(report: dict, out: Path) -> None:
    plt = pyplot()
    layers = sorted(report["layers"])
    summary = report["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = np.array_split(np.array(layers), min(4, len(layers)))
    distances = list(range(1, 9))
    for g in groups:
        if not len(g):
            continue
        ys = [np.nanmean([report["layers"][l]["overlap"][d] for l in g]) for d in distances]
        ax1.plot(distances, ys, marker="o", label=f"layers {g[0]}-{g[-1]}" if len(g) > 1 else f"layer {g[0]}")
    ax1.axhline(summary["overlap_independent"], color="gray", ls="--", label="independent tokens (same popularity)")
    ax1.plot(distances, [summary["overlap_shuffled"][d] for d in distances], color="gray", ls=":", label="shuffle control")
    ax1.axhline(summary["overlap_uniform"], color="black", ls="-.", label="uniform routing k/N")
    ax1.set_xlabel("distance d (tokens)")
    ax1.set_ylabel("overlap |E_t ∩ E_t+d| / k")
    ax1.set_title("Expert overlap between tokens d apart")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    windows = list(range(1, 9))
    ax2.plot(windows, [summary["unique"][t] for t in windows], marker="o", label="measured")
    ax2.plot(windows, [summary["unique_independent"][t] for t in windows], ls="--", color="gray", label="independent tokens")
    ax2.plot(windows, [summary["unique_uniform"][t] for t in windows], ls="-.", color="black", label="uniform N(t)")
    ax2.set_xlabel("window t (tokens, e.g. K+1 of a verify pass)")
    ax2.set_ylabel("unique experts per layer")
    ax2.set_title(f"Unique experts per window (k={summary['top_k']}, N={summary['n_experts']})")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{report['model'].get('name')}: {summary['tokens']} tokens in {summary['sequences']} sequences")
    fig.tight_layout()
    tmp = Path(out).with_name(f".{Path(out).stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
