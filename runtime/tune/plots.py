"""Plots for sweeps: tok/s vs cutoff (chosen L marked), hit rate vs cache size per policy."""

from __future__ import annotations

from pathlib import Path

from runtime.observe import pyplot


def _save(fig, plt, out: Path) -> None:
    fig.tight_layout()
    tmp = Path(out).with_name(f".{Path(out).stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


def plot_cutoff(points: list[dict], chosen: int, title: str, out: Path) -> None:
    plt = pyplot()
    pts = sorted(points, key=lambda p: p["cutoff"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs, ys = [p["cutoff"] for p in pts], [p["tokens_per_s"] for p in pts]
    lo = [y - p.get("tokens_per_s_min", y) for p, y in zip(pts, ys)]
    hi = [p.get("tokens_per_s_max", y) - y for p, y in zip(pts, ys)]
    ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4,
                label="median of passes (median over prompts each); bars: min-max of passes")
    best = [p for p in pts if p["cutoff"] == chosen]
    if best:
        ax.plot([chosen], [best[0]["tokens_per_s"]], marker="*", markersize=16, color="tab:red", ls="none",
                label=f"chosen L = {chosen}")
    ax.set_xlabel("cutoff L (prefetch for the first L MoE layers; 0 = off)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend()
    _save(fig, plt, out)


def plot_cache(rows: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy in sorted({r["policy"] for r in rows}, key=lambda p: (p != "belady", p)):
        pts = sorted((r["fraction"], r["hit_rate"]) for r in rows if r["policy"] == policy)
        style = dict(color="black", lw=2.5) if policy == "belady" else {}
        ax.plot([x * 100 for x, _ in pts], [y for _, y in pts], marker="o", label=policy.replace("belady", "Belady MIN (offline optimum)"), **style)
    ax.set_xlabel("cache size (% of a layer's experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, plt, out)
