"""`--kv-bits`: what a quantized KV cache saves at a long context, and what it changes.

Physics: the KV cache grows by layers x 2 x kv_heads x head_dim values a token (float32 here: 4 bytes each);
mlx-lm's quantized cache stores 8 (or 4) bits a value plus a scale and a bias per group of 64, from its
`quantized_kv_start` (5000 tokens) on: the cache is converted once it holds that many, so the prefill's first
5000+ tokens still run unquantized and the saving grows with the context past them. Quantized keys and values
are lossy by design (as in mlx-lm): greedy tokens may differ from the unquantized run's.

Measured through the public API (`runtime.load` + `runtime.stream_generate(kv_bits=...)`, plain decoding, a
full budget so that only the KV differs) on a synthetic qwen3_moe with head_dim 64 (mlx-lm's quantized cache
needs head_dim divisible by its group of 64; the embedded target's head_dim is 32, so mlx-lm's `to_quantized`
refuses it). Per context length and kv_bits: the KV cache's bytes after the run (a PromptCache's caches, as
`chat` and `serve` keep them), the MLX allocator peak during the call, decode tok/s (the machine's load decides
it; not the point of the flag), and the greedy tokens against the unquantized run's (tokens equal before the first
difference). The default context, 5200 tokens, is just past quantized_kv_start: on this 2-core CPU a prefill of
5200 tokens takes minutes (stock mlx-lm's alike). Prints a table and ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import load, stream_generate  # noqa: E402
from runtime.checkpoints import make_tiny  # noqa: E402
from runtime.decode import PromptCache  # noqa: E402


def run(engine, ids: list[int], n: int, kv_bits: int | None) -> dict:
    pc = PromptCache(engine.model.model)  # as chat and serve keep a conversation's KV
    rs = list(stream_generate(engine, ids, n, kv_bits=kv_bits, prompt_cache=pc))
    last = rs[-1]
    return {"tokens": [r.token for r in rs], "kv_bytes": sum(c.nbytes for c in pc.cache),
            "kv_quantized": any(hasattr(c, "bits") for c in pc.cache),
            "peak_gb": last.stats.peak_memory_gb, "decode_tps": last.stats.tokens_per_s}


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens the two runs share."""
    return len(os.path.commonprefix([a, b]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="5200", help="prompt lengths in tokens")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded after each prompt")
    ap.add_argument("--bits", default="8,4")
    args = ap.parse_args()
    load_before = os.getloadavg()
    bits = [None] + [int(b) for b in args.bits.split(",")]
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "synthetic", "qwen3_moe", seed=0, layers=8, n_experts=16, top_k=4, hidden=256,
                         expert_hidden=128)
        with load(path, budget="100%") as engine:
            cfg = engine.model.config
            vocab = cfg["vocab_size"]
            for n_ctx in (int(c) for c in args.contexts.split(",")):
                print(f"context {n_ctx} ...", file=sys.stderr, flush=True)
                ids = [3 + (i * 7919) % (vocab - 3) for i in range(n_ctx)]
                base = None
                for b in bits:
                    r = run(engine, ids, args.tokens, b)
                    base = base or r
                    r["equal_prefix"] = agree(base["tokens"], r["tokens"])
                    out[f"{n_ctx}/{b}"] = r
                    rows.append((n_ctx, b, r, base))
    print(f"synthetic qwen3_moe, 8 layers, hidden 256, head_dim 64, 2 KV heads, float32 activations; full budget; "
          f"greedy, {args.tokens} tokens after each prompt; mlx-lm's quantized_kv_start 5000, group 64")
    print(f"{'context':>8}{'kv_bits':>8}{'KV MB':>9}{'vs none':>9}{'peak GB':>9}{'vs none':>9}{'tok/s':>8}"
          f"{'greedy tokens equal':>22}")
    for n_ctx, b, r, base in rows:
        print(f"{n_ctx:>8}{str(b):>8}{r['kv_bytes'] / 1e6:>9.1f}{r['kv_bytes'] / base['kv_bytes']:>9.2f}"
              f"{r['peak_gb']:>9.3f}{r['peak_gb'] / base['peak_gb']:>9.2f}{r['decode_tps']:>8.1f}"
              f"{str(r['equal_prefix']) + '/' + str(args.tokens):>22}")
    print(json.dumps({"bench": "kv_bits", "contexts": args.contexts, "tokens": args.tokens,
                      "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": out}))


if __name__ == "__main__":
    main()
