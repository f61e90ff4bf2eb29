"""A conversation's second turn: prefill only its own tokens, output equal to a from-scratch run.

Physics: a chat's second turn repeats the first turn and its reply as its prefix. Prefilled from
scratch, every turn costs the whole conversation so far; with the KV cache and state kept
(runtime/decode/PromptCache) only the new tokens run, so the second turn's prefill tokens and time
scale with the turn, not the conversation.

Method: a qwen3_moe checkpoint (4 MoE layers x 64 experts, top-4, hidden 128; --family for another
built-in family) at --budget; turn 1 is --first prompt tokens from the calibration text, greedy
--generate tokens; turn 2 appends --second new tokens to turn 1's prompt and reply. The second turn
runs with the kept PromptCache and, in a fresh OffloadedModel, from scratch; stock mlx-lm (resident)
runs the full second-turn prompt from scratch as the reference. Repeats interleaved; median (min-max).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.checkpoints import make_tiny  # noqa: E402
from runtime.decode import OffloadConfig, OffloadedModel, PromptCache, generate_tokens  # noqa: E402


def text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode((files("runtime") / "data" / "calibration.txt").read_text())
    ids = ids * ((n + offset) // len(ids) + 1)
    return ids[offset : offset + n]


def stock_greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(token))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--first", type=int, default=1000, help="turn 1 prompt tokens")
    ap.add_argument("--second", type=int, default=100, help="turn 2 new prompt tokens")
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "m", args.family, seed=0, layers=4, n_experts=64, top_k=4, hidden=128,
                         expert_hidden=128)
        stock, tok = load(str(path))
        turn1 = text_ids(tok, args.first)
        kept, scratch, rows = [], [], []
        for _ in range(args.repeats):
            om = OffloadedModel.load(path, OffloadConfig(budget=args.budget, governor=None))
            try:
                pc = PromptCache(om.model)
                reply, _ = generate_tokens(om.model, turn1, max_tokens=args.generate, om=om, prompt_cache=pc)
                turn2 = turn1 + reply + text_ids(tok, args.second, offset=args.first)
                t0 = time.perf_counter()
                out_kept, st_kept = generate_tokens(om.model, turn2, max_tokens=args.generate, om=om, prompt_cache=pc)
                kept.append(time.perf_counter() - t0)
            finally:
                om.close()
            om = OffloadedModel.load(path, OffloadConfig(budget=args.budget, governor=None))
            try:
                t0 = time.perf_counter()
                out_scratch, st_scratch = generate_tokens(om.model, turn2, max_tokens=args.generate, om=om)
                scratch.append(time.perf_counter() - t0)
            finally:
                om.close()
            ref = stock_greedy(stock, turn2, args.generate)
            rows.append({"kept_prefill_tokens": st_kept.prefill.n_tokens, "reused": st_kept.prefill.reused_tokens,
                         "scratch_prefill_tokens": st_scratch.prefill.n_tokens, "kept_prefill_s": st_kept.prefill.seconds,
                         "scratch_prefill_s": st_scratch.prefill.seconds, "equal_scratch": out_kept == out_scratch,
                         "equal_stock": out_kept == ref, "turn2_tokens": len(turn2)})

    r = rows[-1]
    kp = [x["kept_prefill_s"] for x in rows]
    sp = [x["scratch_prefill_s"] for x in rows]
    equal = all(x["equal_scratch"] and x["equal_stock"] for x in rows)
    print(f"model: {args.family} 4 layers x 64 experts, hidden 128, budget {args.budget}; turn 1: {args.first} prompt "
          f"tokens + {args.generate} generated; turn 2 appends {args.second} tokens ({r['turn2_tokens']} in all); "
          f"{args.repeats} repeats, median (min-max)")
    print(f"{'turn 2':<22}{'prefill tokens':>16}{'reused':>8}{'prefill s':>24}{'turn s':>24}")
    fmt = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
    print(f"{'kept prompt cache':<22}{r['kept_prefill_tokens']:>16}{r['reused']:>8}{fmt(kp):>24}{fmt(kept):>24}")
    print(f"{'from scratch':<22}{r['scratch_prefill_tokens']:>16}{0:>8}{fmt(sp):>24}{fmt(scratch):>24}")
    print(f"second-turn output equal to the from-scratch run and to stock mlx-lm (greedy), every repeat: {equal}")
    print(json.dumps({"bench": "prompt_cache", "family": args.family, "budget": args.budget, "repeats": args.repeats,
                      "equal": equal, "rows": rows}))


if __name__ == "__main__":
    main()
