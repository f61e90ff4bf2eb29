"""Stock mlx-lm's batched generation against its own single-sequence generation (no specmoe code runs).

Physics: a batch of B sequences runs each layer on a (B, T, D) tensor, with left padding and a mask
for prompts of different lengths (mlx-lm's BatchKVCache); one sequence runs on (1, T, D) with no
padding. The arithmetic is the same per row, but matmul blocking, reductions and the masked softmax
may round differently, so logits can differ in the last bits and, rarely, flip a greedy argmax. mlx-lm
accepts that; specmoe's batched decoding is defined against stock's *batched* output
(tests/test_batch_generate.py), its single-sequence decoding against stock's single-sequence output.

Method: every family of the tiny fixtures (runtime/checkpoints/tiny.py, 3 layers x 32 experts, top-4,
random weights) and the embedded trained target; --n-prompts prompts of different lengths from the
calibration text, --max-tokens greedy tokens each, stock mlx-lm's BatchGenerator (all prompts at
once) vs generate_step per prompt. For each model: how many sequences' tokens differ, the first
differing position, and the largest |difference| of the log-probabilities over the steps both agree on.
Prints a table and ends with one JSON line (bench/run_all.sh writes it to bench/results/ with the date and
load average).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.checkpoints.embedded import embedded_pair  # noqa: E402
from runtime.checkpoints.tiny import FAMILIES, make_tiny  # noqa: E402


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode((files("runtime") / "data" / "calibration.txt").read_text())
    return [ids[97 * i: 97 * i + 5 + 11 * i] for i in range(n)]  # 5, 16, 27, ... tokens


def batched(model, prompts, n: int):
    gen = BatchGenerator(model, max_tokens=n)
    uids = gen.insert(prompts, [n] * len(prompts))
    toks, lps = {u: [] for u in uids}, {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            toks[r.uid].append(r.token)
            lps[r.uid].append(r.logprobs)
    gen.close()
    return [toks[u] for u in uids], [lps[u] for u in uids]


def single(model, prompt, n: int):
    toks, lps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=n):
        toks.append(int(token))
        lps.append(logprobs)
    return toks, lps


def compare(model, prompts, n: int) -> dict:
    b_toks, b_lps = batched(model, prompts, n)
    differ, first, max_diff = 0, None, 0.0
    for p, bt, bl in zip(prompts, b_toks, b_lps):
        st, sl = single(model, p, n)
        at = next((i for i, (x, y) in enumerate(zip(bt, st)) if x != y), None)
        if at is not None:
            differ += 1
            first = at if first is None else min(first, at)
        for i in range(at if at is not None else len(bt)):
            max_diff = max(max_diff, float(mx.abs(bl[i] - sl[i]).max()))
    return {"sequences": len(prompts), "differ": differ, "first_diff": first, "max_logprob_diff": max_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-prompts", type=int, default=4, help="prompts per batch (different lengths)")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {fam: make_tiny(Path(tmp) / fam, fam, seed=1, layers=3, n_experts=32, top_k=4) for fam in FAMILIES}
        paths["embedded target"] = embedded_pair().target
        for name, path in paths.items():
            model, tok = load(str(path))
            rows[name] = compare(model, prompts_for(tok, args.n_prompts), args.max_tokens)
    lines = [f"stock mlx-lm: BatchGenerator ({args.n_prompts} prompts of different lengths at once) vs generate_step "
             f"per prompt, {args.max_tokens} greedy tokens each",
             f"{'model':<18}{'sequences differing':>22}{'first diff at':>15}{'max |d logprob| while equal':>30}"]
    for name, r in rows.items():
        first = "-" if r["first_diff"] is None else str(r["first_diff"])
        lines.append(f"{name:<18}{r['differ']:>16} of {r['sequences']:<3}{first:>15}{r['max_logprob_diff']:>30.2e}")
    table = "\n".join(lines)
    print(table)
    record = {"bench": "batch_stock_drift", "n_prompts": args.n_prompts, "max_tokens": args.max_tokens, "rows": rows}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
