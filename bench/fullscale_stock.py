"""Stock mlx-lm on a checkpoint, all weights resident: the reference tokens and speed of a capped run.

    python -m bench.fullscale_stock --model DIR --prompt TEXT -n 12 --json OUT

Greedy decoding with mlx-lm's own `load` and `generate_step` on the raw prompt (no chat template, as
`specmoe generate --raw-prompt`), timing the first token (prefill) apart from the rest (decode).
Writes {"tokens", "prefill_s", "decode_s", "tokens_per_s", "load_s"} to --json.

Invariant: nothing of specmoe runs here; the model is loaded fully before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def stock_run(model_dir: str, prompt: str, max_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    model, tokenizer = load(model_dir)
    load_s = time.perf_counter() - t0
    ids = tokenizer.encode(prompt)
    tokens, t_first = [], None
    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if t_first is None:
            t_first = time.perf_counter()
        if len(tokens) == max_tokens:
            break
    t_end = time.perf_counter()
    decode_s = t_end - t_first
    return {"tokens": tokens, "n_prompt_tokens": len(ids), "prefill_s": t_first - t0, "decode_s": decode_s,
            "tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0, "load_s": load_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="mlx-lm checkpoint directory")
    ap.add_argument("--prompt", required=True, help="raw prompt text")
    ap.add_argument("-n", "--max-tokens", type=int, default=12, help="greedy tokens to generate")
    ap.add_argument("--json", required=True, help="where to write the result")
    args = ap.parse_args(argv)
    result = stock_run(args.model, args.prompt, args.max_tokens)
    with open(args.json, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
