"""Peak MLX memory of a short generate run: stock mlx-lm against specmoe at several budgets.

Physics: stock mlx-lm holds every expert; specmoe holds the resident weights plus the
expert slabs its budget buys, so peak memory should follow the budget. Measured on an
expert-heavy synthetic checkpoint (experts ~95% of the bytes, as in a 35B-A3B model),
each variant `--trials` times, interleaved, from a cleared MLX cache (mx.reset_peak_memory).
Peak memory is deterministic up to allocator rounding, so the spread should be ~0;
it is printed to show that. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from runtime.checkpoints import make_tiny  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel  # noqa: E402

PROMPT = "Experts live on disk."


def _greedy(model, ids: list[int], n: int) -> None:
    from mlx_lm.generate import generate_step

    for _, (token, _) in zip(range(n), generate_step(mx.array(ids), model, sampler=lambda x: mx.argmax(x, axis=-1))):
        pass


def peak_bytes(path: Path, budget: str | None, tokens: int) -> tuple[int, int]:
    mx.clear_cache()
    mx.reset_peak_memory()
    if budget is None:
        model, tok = load(str(path))
        _greedy(model, tok.encode(PROMPT), tokens)
        return mx.get_peak_memory(), 0
    om = OffloadedModel.load(path, OffloadConfig(budget=budget, governor=None))
    try:
        _greedy(om.model, om.tokenizer.encode(PROMPT), tokens)
        return mx.get_peak_memory(), om.store.expert_bytes_total
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="100%,50%,25%,12.5%")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    variants = [None] + args.budgets.split(",")
    samples: dict = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "m", "qwen3_moe", seed=4, layers=4, n_experts=64, top_k=4, hidden=128,
                         expert_hidden=128)
        expert_bytes = 0
        for _ in range(args.trials):
            for v in variants:
                peak, eb = peak_bytes(path, v, args.tokens)
                samples[v].append(peak)
                expert_bytes = eb or expert_bytes
    name = lambda v: "stock mlx-lm" if v is None else f"specmoe {v}"  # noqa: E731
    print(f"peak MLX memory of a {args.tokens}-token greedy run, {expert_bytes / 1e6:.1f} MB of experts; "
          f"median [min-max] of {args.trials} interleaved trials")
    print(f"{'variant':<16}{'peak MB':>9}{'min-max':>16}{'vs stock':>10}")
    stock = statistics.median(samples[None])
    results = {}
    for v in variants:
        med = statistics.median(samples[v])
        results[name(v)] = {"peak_mb": med / 1e6, "min_mb": min(samples[v]) / 1e6, "max_mb": max(samples[v]) / 1e6,
                            "vs_stock": med / stock}
        print(f"{name(v):<16}{med / 1e6:>9.2f}{f'{min(samples[v]) / 1e6:.2f}-{max(samples[v]) / 1e6:.2f}':>16}"
              f"{med / stock:>10.2f}")
    print(json.dumps({"bench": "memory", "expert_mb": expert_bytes / 1e6, "tokens": args.tokens, "trials": args.trials,
                      "results": results}))


if __name__ == "__main__":
    main()
